"""Work done by this process, counted where it happens, for the engine core's heartbeat thread to report: the
model runner on the CPU counts each module forward it runs (worker/model_runner.py), so that a long step (a
7,000-token prefill, a long embedding, a beam's long prompt) reads as work in progress, and a loop stuck inside a
step (a deadlock, a lost collective) reads as none. The watchdog (MPClient._check_engines) takes either a finished
step or more work as progress."""
from __future__ import annotations

_done = 0


def tick(*_) -> None:
    """One unit of work done (a forward hook's signature: the arguments are ignored)."""
    global _done
    _done += 1


def work_done() -> int:
    return _done


def count_forwards(*models) -> None:
    """Count every forward of the models' leaf modules (linear layers, norms, attention, ...) as work: a few
    hundred Python calls a step, noise beside a CPU step's compute (not used on CUDA, whose steps are short and
    whose forwards only launch kernels)."""
    for model in models:
        if model is None:
            continue
        for m in model.modules():
            if next(m.children(), None) is None:
                m.register_forward_hook(tick)

"""The executor: what the engine core drives the model through. One implementation runs the model runner in the
engine's own process (uni); the others run one worker per tensor-parallel rank (mp: local processes, ray: Ray
actors) and broadcast every step to all of them."""
from __future__ import annotations

import torch

from kestrel.core.kv_spec import KVCacheGroup
from kestrel.core.step import StepInput
from kestrel.errors import InvalidRequest, KestrelError


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the executor is dead after it (the engine reports dead)."""


class ControlCallError(KestrelError):
    """A control call (`Executor.call_all`) failed on at least one rank. Raised after every rank answered;
    `outcomes[r]` is rank r's result or its exception. A 400 when every rank refused the call as bad input (the
    same adapter is bad everywhere), a 500 otherwise."""

    def __init__(self, method: str, outcomes: list):
        self.method = method
        self.outcomes = outcomes
        failed = {r: o for r, o in enumerate(outcomes) if isinstance(o, BaseException)}
        messages = {str(e) for e in failed.values()}
        if len(outcomes) == 1:
            text = str(failed[0])
        elif len(failed) == len(outcomes) and len(messages) == 1:
            text = f"{messages.pop()} (on every tensor-parallel rank)"
        else:
            text = f"{method} failed on tensor-parallel rank(s) {sorted(failed)}: " + "; ".join(
                f"rank {r}: {o}" if r in failed else f"rank {r}: ok" for r, o in enumerate(outcomes))
        super().__init__(text)
        if len(failed) == len(outcomes) and all(isinstance(e, InvalidRequest) for e in failed.values()):
            self.status_code, self.error_type = 400, "invalid_request_error"

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r, o in enumerate(self.outcomes) if isinstance(o, BaseException)]


class Executor:
    model_config: "object"  # HFConfig
    tokenizer: object
    device: torch.device
    kv_cache_groups: list[KVCacheGroup]
    bytes_per_block: int

    def start_up(self) -> int:
        """The start-up after the model loaded, on every rank (kestrel/worker/build.py start_up): precompile, size
        the KV cache (the minimum over ranks), allocate it and set up what needs it. Returns the number of blocks."""
        raise NotImplementedError

    def launch(self, step: StepInput, prev=None, sample: bool = True, before_forward=None):
        """Start a step and return a handle for `collect` (its `samples` says whether it samples tokens). With
        sample=False the caller passes a token bitmask to `sample` first (handle.rows: request id -> its row).
        `before_forward()` is called once the step's inputs are staged, before its forward is queued: where
        `prev` has not sampled yet (its bitmask was filling), the caller samples it there."""
        raise NotImplementedError

    def sample(self, handle, bitmask=None) -> None:
        raise NotImplementedError

    def collect(self, handle):
        """The RunnerOutput of a launched step, in launch order."""
        raise NotImplementedError

    def call_all(self, method: str, *args, timeout: float | None = None) -> list:
        """Run the control method `method(*args)` (one of kestrel/worker/control.py's CONTROL_METHODS) on every
        rank and return each rank's result, in rank order. It waits for every rank, then raises one
        ControlCallError carrying every rank's outcome if any failed (undoing where it succeeded is the caller's).
        A rank that does not answer within `timeout` seconds, or dies, fails the executor (WorkerError)."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise WorkerError when a worker is gone."""

    def shutdown(self) -> None:
        pass


class UniExecutor(Executor):
    """Today's fast path: the model runner in the engine process."""

    def __init__(self, config, progress: bool = True):
        from kestrel.executor.runner_build import build_runner

        self.runner = build_runner(config, progress)
        self.model_config = self.runner.model_config
        self.tokenizer = self.runner.loaded.tokenizer
        self.device = self.runner.device
        self.kv_cache_groups = self.runner.kv_cache_groups

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    def start_up(self) -> int:
        from kestrel.worker.build import start_up

        started = start_up(self.runner.parts)  # the runner's start-up order, in one function
        self.runner.adopt(started)
        return started.num_blocks

    def launch(self, step: StepInput, prev=None, sample: bool = True, before_forward=None):
        return self.runner.launch(step, prev, sample, before_forward)

    def sample(self, handle, bitmask=None) -> None:
        self.runner.sample(handle, bitmask)

    def collect(self, handle):
        return self.runner.collect(handle)

    def call_all(self, method: str, *args, timeout: float | None = None) -> list:
        from kestrel.worker.control import run_control

        try:
            return [run_control(self.runner, method, args)]
        except Exception as e:  # noqa: BLE001 - the call fails, the runner goes on
            raise ControlCallError(method, [e]) from e

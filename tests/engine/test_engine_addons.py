"""The engine core drives features it does not know: a test-only engine add-on (one class here, registered with
one table line) refuses a request, holds a waiting one back, counts steps and answers a utility call, while the
core names no feature (kestrel/engine/core.py and scheduler.py, checked by reading them)."""
import ast
import re
from pathlib import Path

import pytest

from kestrel import LLM, SamplingParams
from kestrel.core.engine_addon import HOOKS, EngineAddon, overriding
from kestrel.engine import addons as engine_addons

ENGINE = Path(__file__).resolve().parents[2] / "kestrel" / "engine"
FEATURES = re.compile(r"lora|grammar|structured|spec|draft|pooling|image|mm_", re.I)


class StepCounter(EngineAddon):
    """Refuses prompts that start with token 13, keeps requests of priority 7 waiting while any request runs, and
    counts the steps whose result it saw (asked over the utility call num_steps)."""
    name = "step_counter"
    utility_methods = ("num_steps",)

    def __init__(self):
        self.steps = 0

    def admit(self, req):
        return "token 13 first is refused" if req.prompt_token_ids[0] == 13 else None

    def can_schedule(self, req, running):
        return req.priority != 7 or not running

    def after_collect(self, sched, result, pending):
        self.steps += 1

    def num_steps(self) -> int:
        return self.steps


def test_a_test_only_addon_refuses_waits_and_counts(tiny_llama, monkeypatch):
    monkeypatch.setattr(engine_addons, "ENGINE_ADDONS", [*engine_addons.ENGINE_ADDONS, StepCounter])  # one line
    llm = LLM(str(tiny_llama), progress=False, async_scheduling="off", max_num_seqs=4)
    core = llm.engine.core
    assert isinstance(core.step_counter, StepCounter) and "num_steps" in core.UTILITY_METHODS
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    refused, ok = llm.generate([[13, 20, 30], [10, 20, 30]], params)
    assert refused.outputs[0].finish_reason == "abort" and refused.outputs[0].token_ids == []
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 4
    steps = core.num_steps()
    assert steps >= 4 and steps == core.step_counter.steps
    # priority 7 waits until nothing runs: the two requests never share a step
    eng = llm.engine
    first = eng.add_request([10, 11, 12], params)
    late = eng.add_request([10, 11, 12], params, priority=7)
    shared = False
    while eng.has_unfinished_requests():
        eng.step()
        running = {r.request_id for r in core.scheduler.running}
        shared |= {first, late} <= running
    assert not shared and core.num_steps() > steps


def test_a_feature_that_is_off_reads_none(tiny_llama):
    core = LLM(str(tiny_llama), progress=False).engine.core
    assert core.speculation is None and core.grammars is not None
    with pytest.raises(AttributeError):
        core.no_such_addon  # noqa: B018


def test_only_overridden_hooks_are_called():
    counter = StepCounter()
    hooks = {h: overriding([counter], h) for h in HOOKS}
    assert hooks["admit"] == [counter.admit] and hooks["after_collect"] == [counter.after_collect]
    assert hooks["release"] == hooks["propose"] == hooks["sample"] == []


@pytest.mark.parametrize("name", ["core.py", "scheduler.py"])
def test_core_and_scheduler_name_no_feature(name):
    tree = ast.parse((ENGINE / name).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not sorted(x for x in names if FEATURES.search(x))


def test_engine_core_stays_small():
    lines = (ENGINE / "core.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("class EngineCore"))
    assert len(lines) - start <= 180

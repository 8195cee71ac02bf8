"""An adapter never takes the engine core down (issue 33 item 3): unloading an adapter while a request for it waits
for its grammar (not yet scheduled) is refused instead of leaving the step to find the adapter gone; a request whose
adapter is gone when it reaches the engine ends as "abort" with a reason; an adapter folder that is corrupted or
unreadable fails its load with a 400 naming the problem, and the engine serves on."""
from __future__ import annotations

import json

import pytest

from kestrel import LLM, SamplingParams
from kestrel.core.sampling_params import StructuredOutputsParams
from kestrel.core.extras import RequestExtras
from kestrel.engine.messages import EngineCoreRequest
from kestrel.errors import InvalidRequest
from kestrel.executor import ControlCallError
from tests.lora.peft_utils import make_adapter
from tests.tiny import make_checkpoint

PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("lora_robust")
    base = make_checkpoint("llama", root, tokenizer=tiny_tokenizer)
    return base, make_adapter(base, root / "good", 8, seed=1)


@pytest.fixture(scope="module")
def llm(base_and_adapter):
    base, _ = base_and_adapter
    return LLM(str(base), progress=False, enable_lora=True, max_lora_rank=8, max_loras=2)


def finish(llm) -> dict[str, object]:
    out = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            if o.finished:
                out[o.request_id] = o
    return out


def test_unload_while_a_request_waits_for_its_grammar(llm, base_and_adapter):
    _, adapter = base_and_adapter
    req = llm.load_lora("a", str(adapter))
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[0-9]{6}"))
    rid = llm.engine.add_request(PROMPT, params, lora_request=req)
    assert [r.request_id for r in core.grammars.compiling] == [rid]  # prepared, not yet in the scheduler
    with pytest.raises(InvalidRequest, match=r"LoRA id \d+ is in use by 1 request"):
        llm.unload_lora("a")
    assert core.lora_control.loras == {req.lora_id: "a"} and "a" in llm.engine.loras
    out = finish(llm)
    assert out[rid].outputs[0].text.isdigit() and len(out[rid].outputs[0].text) == 6
    assert llm.unload_lora("a") and core.lora_control.loras == {}


def test_request_for_an_unloaded_adapter_aborts_with_a_reason(llm, base_and_adapter):
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("late", PROMPT, params, 4, 0.0, extras=RequestExtras(lora_id=777)))
    core.add_request(EngineCoreRequest("base", PROMPT, params, 4, 0.0))
    outs = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.finish_reason:
                outs[o.request_id] = o
    assert outs["late"].finish_reason == "abort" and outs["late"].stop_reason == "LoRA adapter id 777 is not loaded"
    assert outs["base"].finish_reason == "length"


def _corrupt(folder, how: str) -> None:
    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    if how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "weights are a folder":
        weights.unlink()
        weights.mkdir()
    elif how == "config not utf-8":
        config.write_bytes(b"\xff\xfe{")
    elif how == "config a list":
        config.write_text(json.dumps([1, 2]))
    elif how == "config a folder":
        config.unlink()
        config.mkdir()
    elif how == "1-d tensor":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        key = next(k for k in tensors if "lora_A" in k)
        tensors[key] = tensors[key].flatten()
        save_file(tensors, str(weights))


@pytest.mark.parametrize("how, message", [
    ("truncated weights", "cannot read adapter_model.safetensors"),
    ("weights are a folder", "no adapter_model.safetensors"),
    ("config not utf-8", "adapter_config.json: not valid JSON"),
    ("config a list", "adapter_config.json: not a JSON object"),
    ("config a folder", "no adapter_config.json"),
    ("1-d tensor", "lora_A / lora_B are not matrices"),
])
def test_corrupted_adapter_fails_its_load_only(llm, base_and_adapter, tmp_path, how, message):
    import shutil

    _, adapter = base_and_adapter
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    _corrupt(bad, how)
    with pytest.raises(ControlCallError, match=message) as err:
        llm.load_lora("bad", str(bad))
    assert err.value.status_code == 400
    assert "bad" not in llm.engine.loras and "bad" not in llm.engine.core.lora_control.loras.values()
    good = llm.load_lora(f"good-{how}", str(adapter))  # the engine serves on, adapters too
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), lora_request=good)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.unload_lora(good.name)


def test_adapter_unreadable_when_read_again_fails_its_requests_only(base_and_adapter, tmp_path):
    """--max-cpu-loras 1: an adapter dropped from host memory is read from disk again when a request needs it; if
    its folder is gone by then, that request ends as "abort" naming the problem, while the base model's request and
    another adapter's in the same steps complete (the engine core does not raise)."""
    import shutil

    base, adapter = base_and_adapter
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=1)
    first = llm.load_lora("first", str(shutil.copytree(adapter, tmp_path / "first")))
    second = llm.load_lora("second", str(adapter))  # pushes "first" out of host memory (one host slot)
    manager = llm.engine.core.executor.runner.lora
    assert first.lora_id not in manager.cpu
    shutil.rmtree(tmp_path / "first")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = {llm.engine.add_request(PROMPT, params, lora_request=lora): name
           for name, lora in (("first", first), ("base", None), ("second", second))}
    out = {ids[rid]: o for rid, o in finish(llm).items()}
    assert out["first"].outputs[0].finish_reason == "abort" and out["first"].outputs[0].token_ids == []
    assert "is not a PEFT adapter folder: no adapter_config.json" in out["first"].outputs[0].stop_reason
    assert [len(out[n].outputs[0].token_ids) for n in ("base", "second")] == [4, 4]
    ref = llm.generate(PROMPT, params, lora_request=second)[0].outputs[0].token_ids
    assert out["second"].outputs[0].token_ids == ref


def test_load_that_fails_on_one_rank_is_undone_where_it_succeeded(llm, base_and_adapter, monkeypatch):
    """The engine core's compensation after a partial control call (one rank of two failed, simulated): the error
    names each rank's outcome (500: not the adapter's fault everywhere) and the rank that loaded it drops it."""
    _, adapter = base_and_adapter
    core = llm.engine.core
    real, calls = core.executor.call_all, []

    def half_failing(method, *args, timeout=None):
        calls.append((method, args))
        if method == "add_lora":
            loaded = real(method, *args)  # "rank 0" loads it, "rank 1" fails
            raise ControlCallError(method, [*loaded, RuntimeError("disk quota exceeded")])
        return real(method, *args)

    monkeypatch.setattr(core.executor, "call_all", half_failing)
    with pytest.raises(ControlCallError, match=r"add_lora failed on tensor-parallel rank\(s\) \[1\]: rank 0: ok; "
                                               r"rank 1: disk quota exceeded") as err:
        llm.load_lora("half", str(adapter))
    lora_id = calls[0][1][0]
    assert err.value.status_code == 500 and err.value.failed_ranks == [1]
    assert calls == [("add_lora", (lora_id, "half", str(adapter))), ("remove_lora", (lora_id,))]
    assert lora_id not in core.executor.runner.lora.registered and lora_id not in core.lora_control.loras
    assert "half" not in llm.engine.loras

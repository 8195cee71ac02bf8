"""LoRA at tensor parallel size 2 (CPU, gloo, float32): the adapters are sharded like their base layers (column-
parallel: B by output rows of each packed shard; row-parallel: A by input columns, the delta summed by the layer's
all-reduce). One batch mixing two adapters and the base model gives the greedy tokens of TP = 1 and of transformers
+ PEFT; load, list and unload reach every rank through the executor's control call (Executor.call_all), and a bad
adapter or an unknown control method fails that call on every rank, not the workers."""
from __future__ import annotations

import pytest

from kestrel.core.sampling_params import SamplingParams
from kestrel.executor import ControlCallError
from tests.lora.peft_utils import hf_greedy, make_adapter
from tests.tp import engine, prompts

pytestmark = pytest.mark.timeout(300)

NUM_TOKENS = 16


def run(eng, batch) -> list[list[int]]:
    """Greedy tokens of (prompt, lora_request) pairs, all added before the first step (one mixed batch)."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    ids = [eng.add_request(p, params, lora_request=lora) for p, lora in batch]
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[i] for i in ids]


# llama: one KV head for two ranks (k/v rows replicated: output_ranges, not an equal split); qwen3: q/k norms
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_mixed_batch_tp2_matches_tp1_and_peft(name, tp_checkpoint, tmp_path):
    base = tp_checkpoint(name)
    adapters = {"all8": make_adapter(base, tmp_path / "all8", 8, seed=1),
                "attn16": make_adapter(base, tmp_path / "attn16", 16, seed=2, targets=["q_proj", "v_proj", "o_proj",
                                                                                    "down_proj"], scale=0.2)}
    p = prompts()
    plan = [(p[0], "all8"), (p[0], "attn16"), (p[0], None), (p[1], "all8"), (p[2], "attn16"), (p[4], None)]
    tokens = {}
    for tp in (1, 2):
        eng = engine(base, tp, enable_lora=True, max_lora_rank=16, max_loras=2)
        try:
            loras = {n: eng.add_lora(n, str(path)) for n, path in adapters.items()}
            if tp == 2:
                expected = sorted([r.lora_id, r.name] for r in loras.values())
                assert eng.core.executor.call_all("list_loras") == [expected, expected]  # every rank holds both
            tokens[tp] = run(eng, [(prompt, loras[a] if a else None) for prompt, a in plan])
        finally:
            eng.core.shutdown()
    assert tokens[2] == tokens[1]
    same_prompt = tokens[2][:3]
    assert len({tuple(t) for t in same_prompt}) == 3, "each adapter must change the first prompt's tokens"
    for i in (0, 1, 3, 4):  # the adapters' rows against transformers + PEFT
        prompt, a = plan[i]
        assert tokens[2][i] == hf_greedy(base, adapters[a], [prompt], NUM_TOKENS)[0], f"row {i} ({a})"


@pytest.fixture(scope="module")
def qwen3_lora_tp2(tp_checkpoint, tmp_path_factory):
    base = tp_checkpoint("qwen3")
    root = tmp_path_factory.mktemp("lora_tp2")
    adapter = make_adapter(base, root / "a", 8, seed=3)
    eng = engine(base, 2, enable_lora=True, max_lora_rank=8, max_loras=1, async_scheduling="on")
    yield eng, base, adapter, root
    eng.core.shutdown()


def test_unload_reaches_every_rank_and_bad_calls_fail_alone(qwen3_lora_tp2):
    eng, base, adapter, root = qwen3_lora_tp2
    ex = eng.core.executor
    pids = list(ex.worker_pids)
    req = eng.add_lora("a", str(adapter))
    assert eng.core.list_loras() == [[req.lora_id, "a"]]
    with_adapter = run(eng, [(prompts()[1], req)])
    assert eng.remove_lora("a")
    assert ex.call_all("list_loras") == [[], []]
    assert eng.core.list_loras() == [] and eng.core.lora_control.loras == {}

    broken = root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 40)  # not a safetensors file
    with pytest.raises(ControlCallError, match=r"cannot read adapter_model\.safetensors.*on every tensor-parallel rank"
                       ) as err:
        eng.add_lora("broken", str(broken))
    assert err.value.status_code == 400 and err.value.failed_ranks == [0, 1]
    with pytest.raises(ControlCallError, match=r"'load_weights' is not a control method") as err:
        ex.call_all("load_weights", "/tmp")
    assert err.value.failed_ranks == [0, 1]

    # the workers live on: the same adapter loads again (new id) and gives the same tokens
    again = eng.add_lora("a", str(adapter))
    assert ex.call_all("list_loras") == [[[again.lora_id, "a"]]] * 2
    assert run(eng, [(prompts()[1], again)]) == with_adapter
    assert ex.worker_pids == pids and ex.dead is None
    assert eng.remove_lora("a")


def test_control_call_while_a_step_is_in_flight(qwen3_lora_tp2):
    """Pipelined decode: the control call is sent while a step is in flight; rank 0's step reply that arrives
    first is kept for collect, and the base request's tokens are those of an undisturbed run."""
    eng, base, adapter, root = qwen3_lora_tp2
    alone = run(eng, [(prompts()[3], None)])
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    rid = eng.add_request(prompts()[3], params)
    out = {}
    for _ in range(3):
        for o in eng.step():
            out[rid] = o
    assert eng.core._inflight is not None
    req = eng.add_lora("mid", str(adapter))
    assert len(eng.core.executor._early) == 1  # the in-flight step's reply, read by the control call
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[rid] = o
    assert list(out[rid].outputs[0].token_ids) == alone[0]
    assert eng.remove_lora(req.name) and eng.core.executor.call_all("list_loras") == [[], []]


def test_adapter_unreadable_when_read_again_fails_its_request_on_every_rank(qwen3_lora_tp2, tmp_path):
    """One host slot per rank: an adapter read again from disk after its folder is gone fails its request
    ("abort", with the reason rank 0 reports) and the workers and the other requests go on."""
    import shutil

    eng, base, adapter, root = qwen3_lora_tp2
    gone = eng.add_lora("gone", str(shutil.copytree(adapter, tmp_path / "gone")))
    kept = eng.add_lora("kept", str(adapter))  # pushes "gone" out of every rank's host memory
    shutil.rmtree(tmp_path / "gone")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = {eng.add_request(prompts()[0], params, lora_request=lora): name
           for name, lora in (("gone", gone), ("base", None), ("kept", kept))}
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[ids[o.request_id]] = o.outputs[0]
    assert out["gone"].finish_reason == "abort" and "no adapter_config.json" in out["gone"].stop_reason
    assert [len(out[n].token_ids) for n in ("base", "kept")] == [4, 4]
    assert eng.core.executor.dead is None
    assert eng.remove_lora("gone") and eng.remove_lora("kept")

"""Acceptance 1 (CPU): one batch mixing three PEFT adapters (ranks 8, 64 and 16, different targets) and the base
model; each request's 32 greedy tokens equal transformers + PEFT with its adapter (the base model without)."""
import pytest

from kestrel import LLM, SamplingParams
from tests.lora.peft_utils import hf_greedy, make_adapter
from tests.tiny import make_checkpoint

PROMPTS = [[5, 17, 99, 3], list(range(10, 40)), [7] * 11 + [42, 43], [200, 201, 202, 203, 204, 205, 206]]
NUM_TOKENS = 32


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def base_and_adapters(request, tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = make_checkpoint(request.param, root, tokenizer=tiny_tokenizer)
    adapters = {
        "r8": make_adapter(base, root / "r8", 8, seed=1),
        "r64": make_adapter(base, root / "r64", 64, seed=2, scale=0.06),
        "attn16": make_adapter(base, root / "attn16", 16, seed=3, targets=["q_proj", "v_proj", "down_proj"],
                               use_rslora=True, scale=0.2),
    }
    return base, adapters


def test_mixed_batch_matches_transformers_peft(base_and_adapters):
    base, adapters = base_and_adapters
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=64, max_loras=4)
    reqs = [llm.load_lora(name, str(path)) for name, path in adapters.items()]
    assert llm.engine.core.executor.runner.lora.backend == "torch"  # the PyTorch reference on the CPU
    per_prompt = reqs + [None]  # 3 adapters + the base model, in one batch
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, lora_request=per_prompt)
    base_ref = hf_greedy(base, None, PROMPTS, NUM_TOKENS)
    for i, (out, lora) in enumerate(zip(outs, per_prompt)):
        ref = base_ref[i] if lora is None else hf_greedy(base, adapters[lora.name], [PROMPTS[i]], NUM_TOKENS)[0]
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({lora.name if lora else 'base'})"
        if lora is not None:  # the adapter matters: without it the tokens differ
            assert ref != base_ref[i], f"adapter {lora.name} does not change prompt {i}'s output"


@pytest.mark.parametrize("base_and_adapters", ["llama"], indirect=True)
def test_prefix_cache_is_per_adapter_and_unknown_adapter_aborts(base_and_adapters):
    """An adapter's request never reuses the base model's (or another adapter's) KV blocks, but does reuse its own;
    a request whose adapter is gone when it reaches the engine ends as "abort" instead of hanging."""
    from kestrel.core.extras import RequestExtras
    from kestrel.engine.messages import EngineCoreRequest

    base, adapters = base_and_adapters
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=64, max_loras=2)
    r8, r64 = (llm.load_lora(n, str(adapters[n])) for n in ("r8", "r64"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = PROMPTS[1]  # 30 tokens: one full 16-token block
    runs = [(None, 0), (r8, 0), (r64, 0), (r8, 16), (None, 16)]  # (adapter, prompt tokens served from the cache)
    outs = {}
    for lora, cached in runs:
        out = llm.generate(prompt, params, lora_request=lora)[0]
        assert out.num_cached_tokens == cached, (lora, out.num_cached_tokens)
        outs.setdefault(lora.name if lora else None, []).append(out.outputs[0].token_ids)
    assert outs["r8"][0] == outs["r8"][1] and outs[None][0] == outs[None][1] != outs["r8"][0]

    core = llm.engine.core
    core.add_request(EngineCoreRequest("gone", prompt, params, 4, 0.0, extras=RequestExtras(lora_id=999)))
    out = core.step()
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in out.outputs] == [("gone", "abort", [])]
    assert not core.has_unfinished_requests()


@pytest.mark.parametrize("base_and_adapters", ["llama"], indirect=True)
def test_one_device_slot_and_one_host_slot(base_and_adapters):
    """--max-loras 1 --max-cpu-loras 1: requests of three adapters take turns in the one device slot (the scheduler
    holds back an adapter with no slot), adapters dropped from host memory are read again from disk, and every
    request gets the tokens it gets with four slots."""
    base, adapters = base_and_adapters
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    names = ["r8", "r64", "attn16", "r8"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for slots in (4, 1):
        llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=64, max_loras=slots,
                  max_cpu_loras=slots)
        for n, p in adapters.items():
            llm.load_lora(n, str(p))
        manager = llm.engine.core.executor.runner.lora
        assert len(manager.cpu) == min(slots, 3) and manager.num_slots == slots
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=names)])
    assert outs[0] == outs[1]

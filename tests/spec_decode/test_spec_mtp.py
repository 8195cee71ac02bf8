"""DeepSeek MTP drafts (speculative_config method "mtp") on a tiny DeepSeek-V3 with MTP layers (CPU, float32):
outputs token-identical to the engine without speculation in a mixed batch (greedy and seeded) with chunked
prefill and forced preemption, k beyond the number of MTP layers; the first draft equals transformers' MtpModel on
the same sequence; the start-up refusals."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.errors import ConfigError
from kestrel.spec_decode.mtp_drafter import MtpDrafter
from tests.spec_decode.mixed import record_drafts_from_position_0, tokens, workload as mixed_workload
from tests.spec_decode.mtp_tiny import mtp_checkpoint
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


def mtp(k):
    return {"method": "mtp", "num_speculative_tokens": k}


def workload():
    return mixed_workload(2)


@pytest.mark.parametrize("opts", [dict(), dict(max_num_batched_tokens=24, num_kv_blocks=12)],
                         ids=["plain", "chunked+preempt"])
@pytest.mark.parametrize("k", [1, 3])
def test_same_outputs_as_without_speculation(mtp_model, opts, k):
    prompts, params = workload()
    ref = tokens(LLM(str(mtp_model), progress=False, **opts), prompts, params)
    llm = LLM(str(mtp_model), progress=False, speculative_config=mtp(k), **opts)
    assert tokens(llm, prompts, params) == ref
    sp = llm.engine.core.speculation
    assert sp.num_drafts > 0 and sp.num_draft_tokens > sp.num_drafts * (k > 1)  # k > 1: the layer is reused
    if "num_kv_blocks" in opts:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_first_draft_is_transformers_mtp_prediction(mtp_model, monkeypatch):
    """Each draft the runner makes from a window that starts at position 0 (the whole sequence: no truncation)
    equals transformers' MtpModel greedy draft on the same tokens, fed the target's hidden states."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    seen = record_drafts_from_position_0(monkeypatch, MtpDrafter)
    prompts, _ = workload()
    llm = LLM(str(mtp_model), progress=False, speculative_config=mtp(1))
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(seen) >= 8

    target = AutoModelForCausalLM.from_pretrained(mtp_model, dtype=torch.float32).eval()
    n = target.config.num_hidden_layers
    ref = MtpModel(target, 1).float().eval()
    from safetensors.torch import load_file
    ckpt = load_file(mtp_model / "model.safetensors")
    state = {}
    for name in ref.state_dict():
        if name.startswith(("embed_tokens", "shared_head", "rotary")):
            continue
        rest = name.removeprefix("layers.0.").removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        state[name] = ckpt[f"model.layers.{n}.{rest}"]
    assert not ref.load_state_dict(state, strict=False).unexpected_keys
    pre_norm = []
    target.model.norm.register_forward_pre_hook(lambda mod, args: pre_norm.append(args[0]))
    prompt_of = {tuple(p[1:]): p[0] for p in prompts[:4]}
    for ids, drafts in seen:
        first = next(f for tail, f in prompt_of.items() if tuple(ids[:len(tail)]) == tail)
        seq = torch.tensor([[first, *ids]])
        with torch.no_grad():
            pre_norm.clear()
            target(seq)
            t = seq.shape[1]
            want, _, _ = ref(input_ids=seq[:, 1:], last_hidden_states=pre_norm[0][:, :t - 1],
                             attention_mask=torch.ones(1, t - 1, dtype=torch.long),
                             position_ids=torch.arange(1, t)[None], mtp_cache=MtpCache(config=ref.config),
                             do_sample=False)
        assert drafts == want[0].tolist()


def test_checkpoint_without_mtp_layers_is_refused(tmp_path, tiny_llama):
    # transformers writes num_mtp_layers=1 into every DeepSeek-V3 config, weights or not
    plain = make_checkpoint("deepseek_v3_moe", tmp_path)
    with pytest.raises(ConfigError, match=r"needs a checkpoint with MTP layer weights: .* declares 1 MTP layers but "
                                          r"has no weights under model\.layers\.3\.\*"):
        LLM(str(plain), progress=False, speculative_config=mtp(2))
    no_mtp = make_checkpoint("deepseek_v3_moe", tmp_path, name="no_mtp", num_mtp_layers=0)
    with pytest.raises(ConfigError, match=r"needs a DeepSeek-V3 checkpoint with MTP layers .*, not "
                                          r"DeepseekV3ForCausalLM with 0"):
        LLM(str(no_mtp), progress=False, speculative_config=mtp(2))
    with pytest.raises(ConfigError, match=r"needs a DeepSeek-V3 checkpoint with MTP layers .*, not LlamaForCausalLM"):
        LLM(str(tiny_llama), progress=False, speculative_config=mtp(2))


def test_checkpoint_missing_some_mtp_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = mtp_checkpoint(tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.3.eh_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"the checkpoint lacks MTP layer 3's weights \['eh_proj.weight'\]"):
        LLM(str(path), progress=False, speculative_config=mtp(2))


@pytest.mark.parametrize("k", [1, 3])
def test_exact_drafter_gets_every_greedy_draft_accepted(tmp_path, k):
    """A target whose next token depends on the last token only and an MTP layer that computes the same: every
    greedy draft is right, so a misplaced hidden state or token (off by one position) would show as rejections."""
    path = mtp_checkpoint(tmp_path, bigram=True)
    prompts, _ = workload()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = tokens(LLM(str(path), progress=False), prompts, params)
    assert any(len(set(r[0])) > 4 for r in ref)  # not a constant output
    llm = LLM(str(path), progress=False, speculative_config=mtp(k), max_num_batched_tokens=24)
    assert tokens(llm, prompts, params) == ref
    sp = llm.engine.core.speculation
    assert sp.num_draft_tokens > len(prompts) and sp.num_accepted_tokens == sp.num_draft_tokens


def test_mtp_with_tensor_parallelism_is_refused(mtp_model):
    with pytest.raises(ConfigError, match=r"does not support method 'mtp' with tensor parallelism"):
        LLM(str(mtp_model), progress=False, speculative_config=mtp(2), tensor_parallel_size=2)


def test_no_drafting_above_disable_by_batch_size_keeps_outputs(mtp_model):
    """Above the limit the engine pipelines plain decode steps (the runner keeps its windows and stops
    drafting); as requests finish it drafts again."""
    prompts, params = workload()
    ref = tokens(LLM(str(mtp_model), progress=False), prompts, params)
    llm = LLM(str(mtp_model), progress=False, speculative_config={**mtp(2), "disable_by_batch_size": 4})
    assert tokens(llm, prompts, params) == ref
    assert llm.engine.core.speculation.num_drafts > 0


def test_quantized_checkpoint_is_refused(mtp_model):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(mtp_model)
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match=r"method 'mtp' does not support quantized checkpoints yet"):
        MtpDrafter(object(), cfg, str(mtp_model), 2, torch.device("cpu"), torch.float32)

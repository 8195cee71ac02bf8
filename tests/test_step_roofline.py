"""benchmarks/step_trace.py's per-step floor: the weights read once, the decode rows' KV context, the prefill FLOPs."""
import pytest

from benchmarks.common import SHAPES, shape_facts
from benchmarks.step_trace import step_roofline_s

CEIL = {"copy_bytes_per_s": 4e12, "bf16_flops_per_s": 8e14}


def test_decode_step_reads_weights_and_kv_context():
    facts = shape_facts("qwen3-0.6b")
    rec = dict(tokens=256, decodes=256, decode_ctx=256 * 1000)
    want = (facts.weight_bytes + 256_000 * facts.kv_bytes_per_token) / 4e12
    assert step_roofline_s(rec, facts, CEIL) == want


def test_prefill_tokens_add_their_flops():
    facts = shape_facts("qwen3-0.6b")
    decode_only = dict(tokens=10, decodes=10, decode_ctx=5000)
    mixed = dict(tokens=1010, decodes=10, decode_ctx=5000)
    extra = step_roofline_s(mixed, facts, CEIL) - step_roofline_s(decode_only, facts, CEIL)
    assert abs(extra - 1000 * facts.flops_per_token / 8e14) < 1e-12


def test_moe_step_reads_only_the_experts_its_tokens_hit():
    facts = shape_facts("qwen3-30b-a3b")
    one = step_roofline_s(dict(tokens=1, decodes=1, decode_ctx=0), facts, CEIL)
    many = step_roofline_s(dict(tokens=256, decodes=256, decode_ctx=0), facts, CEIL)
    assert one < many <= facts.weight_bytes / 4e12


def _tiny_kimi() -> dict:
    return dict(SHAPES["kimi-linear-48b"], hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_token=2,
                vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                                     "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4})


def test_kimi_linear_facts_count_the_parameters_transformers_builds(monkeypatch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _tiny_kimi()
    monkeypatch.setitem(SHAPES, "tiny-kimi", cfg)
    facts = shape_facts("tiny-kimi")
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")},
                                  model_type="kimi_linear")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # the facts count matmul weights and the convolution, not the norms, gate biases or A_log
    skip = ("norm", "A_log", "dt_bias", "e_score_correction_bias")
    counted = sum(p.numel() for n, p in model.named_parameters() if not any(s in n for s in skip))
    assert facts.params == counted


def test_kimi_linear_state_is_what_the_engine_allocates():
    import torch

    from kestrel.core.kv_spec import KDAStateSpec
    facts = shape_facts("kimi-linear-48b")
    lin = SHAPES["kimi-linear-48b"]
    spec = KDAStateSpec(torch.bfloat16, num_heads=lin["linear_attn_config"]["num_heads"],
                        head_dim=lin["linear_attn_config"]["head_dim"],
                        conv_width=lin["linear_attn_config"]["short_conv_kernel_size"])
    per_layer = sum(torch.empty((), dtype=dt).element_size() * torch.Size(shape).numel()
                    for dt, shape in spec.state_parts())
    assert facts.state_bytes_per_seq == len(lin["linear_attn_config"]["kda_layers"]) * per_layer
    assert facts.kv_bytes_per_token == 7 * (512 + 64) * 2  # the 7 MLA layers' latents


def _tiny_qwen36() -> dict:
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    return dict(SHAPES["qwen3.6-35b-a3b"], hidden_size=64, num_hidden_layers=4, layer_types=layer_types,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, vocab_size=1000,
                bos_token_id=1, eos_token_id=2)


def test_gdn_facts_count_the_parameters_transformers_builds(monkeypatch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _tiny_qwen36()
    monkeypatch.setitem(SHAPES, "tiny-qwen36", cfg)
    facts = shape_facts("tiny-qwen36")
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")},
                                  model_type=cfg["model_type"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # the facts count matmul weights and the convolution, not the norms, A_log or dt_bias
    skip = ("norm", "A_log", "dt_bias")
    counted = sum(p.numel() for n, p in model.named_parameters() if not any(s in n for s in skip))
    assert facts.params == counted


def test_gdn_state_is_what_the_engine_allocates():
    import torch

    from kestrel.core.kv_spec import GDNStateSpec
    s = SHAPES["qwen3.6-35b-a3b"]
    facts = shape_facts("qwen3.6-35b-a3b")
    spec = GDNStateSpec(torch.bfloat16, num_heads=s["linear_num_value_heads"], head_dim=s["linear_key_head_dim"],
                        conv_width=s["linear_conv_kernel_dim"], num_key_heads=s["linear_num_key_heads"],
                        value_head_dim=s["linear_value_head_dim"])
    per_layer = sum(torch.empty((), dtype=dt).element_size() * torch.Size(shape).numel()
                    for dt, shape in spec.state_parts())
    assert facts.state_bytes_per_seq == 30 * per_layer  # 30 GDN layers of 40
    assert facts.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2  # the 10 attention layers' K and V


@pytest.mark.parametrize("kind", ["gemma4_moe", "gemma4_kv_shared"])
def test_gemma4_facts_count_the_parameters_transformers_builds(monkeypatch, kind):
    """The tiny Gemma 4 configs (MoE + K = V; per-layer inputs + KV sharing + double-wide MLPs) and the real shape's
    facts as transformers' model counts them (matmul weights and embedding tables; not norms or scales)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny import BASE, GEMMA4_CONFIGS

    model_type, extra = GEMMA4_CONFIGS[kind]
    cfg = {**SHAPES["gemma4-26b-a4b"], **BASE, **extra}
    monkeypatch.setitem(SHAPES, "tiny-gemma4", cfg)
    facts = shape_facts("tiny-gemma4")
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")},
                                  model_type=model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = ("norm", "scale", "layer_scalar")
    counted = sum(p.numel() for n, p in model.named_parameters() if not any(s in n for s in skip))
    assert facts.params == counted
    real = shape_facts("gemma4-26b-a4b")
    assert real.kv_bytes_per_token == (25 * 2 * 8 * 256 + 5 * 2 * 2 * 512) * 2
    assert 25e9 < real.params < 27e9 and real.num_experts == 128 and real.top_k == 8

"""Tiny random-weight checkpoints saved as real HF folders (config.json + safetensors + tokenizer)."""
from __future__ import annotations

from pathlib import Path

import torch

from kestrel.bench.tiny_tokenizer import VOCAB_SIZE, make_tokenizer

BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, first_k_dense_replace=2,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

CONFIGS = {
    "llama": ("llama", {}),
    "llama_gqa_llama3": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "llama_linear_rope": ("llama", dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_yarn": ("llama", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),
    "gemma": ("gemma", dict(num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh",
                            tie_word_embeddings=True)),
    # 6 layers: 5 sliding (window 8, smaller than most prompts) + 1 full; linear rope scaling on the full layer;
    # both soft-caps on so the capped paths run
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                   query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
                                   final_logit_softcapping=30.0, tie_word_embeddings=True, rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 1000000.0}})),
    # MLA (all layers dense: first_k_dense_replace covers both). V2: q compression, default rope; V2-Lite: no q
    # compression, YaRN with V2's mscales; V3: q compression, YaRN with mscale_all_dim (the softmax-scale
    # correction), interleaved rope. v_head_dim differs from the qk head dim, as in the real models.
    "deepseek_v2": ("deepseek_v2", dict(**_MLA, q_lora_rank=32)),
    "deepseek_v2_lite": ("deepseek_v2", dict(**_MLA, q_lora_rank=None, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})),
    "deepseek_v3": ("deepseek_v3", dict(**_MLA, q_lora_rank=24, rope_interleave=True, n_group=1, topk_group=1,
                                        rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                      "original_max_position_embeddings": 64, "mscale": 1.0,
                                                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
}

# MoE families (their own fixture in tests/models/test_moe_models.py, so the dense tests do not build them).
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
MOE_CONFIGS = {
    "qwen2_moe": ("qwen2_moe", dict(_MOE, num_key_value_heads=2, num_experts=8, shared_expert_intermediate_size=64,
                                    norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("qwen3_moe", dict(_MOE, num_key_value_heads=2, head_dim=32, num_experts=8, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=32)),
    "glm4_moe": ("glm4_moe", dict(_MOE, num_hidden_layers=3, num_key_value_heads=2, n_routed_experts=8,
                                  n_shared_experts=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                                  routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                                  use_qk_norm=True)),
}

# DeepSeek MLA + MoE (their own fixture in tests/models/test_deepseek.py): layer 0 dense, then routed + shared
# experts. V2: softmax, group-limited greedy; V3: sigmoid + correction bias, grouped top-k, renormalised, scaled
MLA_MOE_CONFIGS = {
    "deepseek_v2_moe": ("deepseek_v2", dict(_MLA, num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=1,
                                            n_routed_experts=8, n_shared_experts=1, topk_method="group_limited_greedy",
                                            n_group=2, topk_group=1, routed_scaling_factor=1.5)),
    "deepseek_v3_moe": ("deepseek_v3", dict(_MLA, num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1,
                                            n_routed_experts=8, n_shared_experts=2, n_group=2, topk_group=1,
                                            norm_topk_prob=True, routed_scaling_factor=2.5)),
}

# DeepSeek Sparse Attention (their own fixture in tests/models/test_dsa.py): V3.2's MLA + MoE with a 16-head
# lightning indexer (fewer heads let ReLU zero whole score rows, and top-k then breaks ties arbitrarily);
# index_topk below the prompt lengths, so the selection matters. GLM-5: its own dims (v_head_dim != nope), the
# interleaved indexer rotary; GLM-5.2: "shared" layers that reuse the previous full layer's selection.
_DSA = dict(_MLA, num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
            topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, index_n_heads=16, index_head_dim=32,
            index_topk=8)
DSA_CONFIGS = {
    "deepseek_v32": ("deepseek_v32", dict(_DSA)),
    "glm_moe_dsa": ("glm_moe_dsa", dict(_DSA, qk_nope_head_dim=24, v_head_dim=16)),
    "glm_moe_dsa_shared": ("glm_moe_dsa", dict(_DSA, num_hidden_layers=4, index_topk_pattern="FSFS")),
}


# Kimi Linear (its own fixture in tests/models/test_kimi_linear.py): layers 1-3 Kimi Delta Attention, layer 4 MLA
# without rotary (the checkpoint's 1-indexed lists); layer 1 dense, then 4 routed experts top-2 + 1 shared
KDA_CONFIGS = {
    "kimi_linear": ("kimi_linear", dict(num_hidden_layers=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
                                        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                                            "num_heads": 4, "head_dim": 16,
                                                            "short_conv_kernel_size": 4})),
}


# Families built from small mechanisms (tests/models/test_families.py): windows and attention chunks of 8, below
# most prompts; 4 layers where a pattern repeats every 4 (3:1 sliding, NoPE every 4th layer)
FAMILY_CONFIGS = {
    "seed_oss": ("seed_oss", dict(num_key_value_heads=2, head_dim=16)),  # q/k/v bias, no o bias (the defaults)
    "smollm3": ("smollm3", dict(num_hidden_layers=4, num_key_value_heads=2)),  # layer 3 NoPE
    "olmo2": ("olmo2", dict(num_key_value_heads=2)),
    "olmo3": ("olmo3", dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=8)),
    # layer 0 dense, then 8 experts top-2 + 1 shared; pair rotary
    "ernie4_5_moe": ("ernie4_5_moe", dict(num_hidden_layers=3, num_key_value_heads=2, moe_num_experts=8, moe_k=2,
                                          moe_intermediate_size=32, moe_num_shared_experts=1)),
    # NTK-alpha base (alpha 1000: a base far from rope_theta), q/k norm after the rotary
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(num_key_value_heads=2, head_dim=16, num_experts=8, moe_topk=2,
                                              intermediate_size=32, rope_parameters={
                                                  "rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0,
                                                  "factor": 1.0})),
    # half of each head rotates; all-heads q/k norm; sigmoid + correction bias
    "minimax_m2": ("minimax_m2", dict(num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                      intermediate_size=32, rope_parameters={
                                          "rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5})),
    # GLM-4 dense: sandwich norms, q/k/v bias, pair rotary on half of each head (the defaults), fused gate_up
    "glm4": ("glm4", dict(num_key_value_heads=2, head_dim=16)),
    # yarn with llama-4 query scaling: the scale steps up every 16 positions (original_max_position_embeddings)
    "ministral3": ("ministral3", dict(num_key_value_heads=2, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5})),
    # DeepSeek-V3's MLA (interleaved rotary, yarn with mscale_all_dim) + MoE routed by a softmax over groups ranked
    # by their top-2 sum, and llama-4 query scaling; layer 0 dense
    "mistral4": ("mistral4", dict(_MLA, num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1,
                                  n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
                                  norm_topk_prob=True, routed_scaling_factor=1.5, rope_interleave=True,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 16, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                   "llama_4_scaling_beta": 0.5})),
    # chunks of 8 on layers 0-2, layer 3 NoPE with temperature tuning stepping every 4 positions; top-1 MoE on
    # layers 1 and 3 (+ a shared expert), dense MLPs (intermediate_size_mlp) on 0 and 2
    "llama4": ("llama4_text", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                   num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=96,
                                   moe_layers=[1, 3], attention_chunk_size=8, floor_scale=4, attn_scale=0.5)),
    # sliding (8) and full layers alternating, both with sinks; q/k/v/o biases; 4 experts top-2 with router and
    # expert biases, interleaved gate/up, clamped SwiGLU; YaRN over an original context of 16
    "gpt_oss": ("gpt_oss", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=32, sliding_window=8, rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})),
}


HF_CLASSES = {"mistral4": "Mistral4ForCausalLM"}


# Gemma 4 (their own fixture in tests/models/test_gemma4.py): sliding (window 8, heads of 16) and global layers
# (heads of 32, "proportional" RoPE on a quarter of them), final soft-capping. K = V on the global layers, 1 KV head
# there (2 on the sliding ones); the MoE block beside the MLP (4 experts, top-2); per-layer inputs of 16 (E2B);
# the last 2 of 4 layers reading the cache of layers 0 and 1, with double-wide MLPs.
_GEMMA4 = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=30.0,
               tie_word_embeddings=True, hidden_size_per_layer_input=0)
GEMMA4_CONFIGS = {
    "gemma4_k_eq_v": ("gemma4_text", dict(_GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1)),
    "gemma4_moe": ("gemma4_text", dict(_GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1,
                                       enable_moe_block=True, num_experts=4, top_k_experts=2,
                                       moe_intermediate_size=32)),
    "gemma4_e2b": ("gemma4_text", dict(_GEMMA4, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB_SIZE)),
    "gemma4_kv_shared": ("gemma4_text", dict(_GEMMA4, hidden_size_per_layer_input=16,
                                             vocab_size_per_layer_input=VOCAB_SIZE, num_kv_shared_layers=2,
                                             use_double_wide_mlp=True)),
}


# Gated DeltaNet hybrids (their own fixture in tests/models/test_gdn_hybrids.py): layers 0-2 GDN (2 key heads
# repeated to 4 value heads, D_k 16, D_v 32: the state [4, 16, 32]), layer 3 gated full attention (2 KV heads of
# 32, partial RoPE 0.25). Qwen3-Next: MoE (4 experts top-2 + a gated shared expert) but layer 1 dense; Qwen3.5:
# dense; Qwen3.5-MoE: MoE on every layer.
_GDN = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4)
_GDN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
GDN_CONFIGS = {
    "qwen3_next": ("qwen3_next", dict(_GDN, **_GDN_MOE, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen3_5": ("qwen3_5_text", dict(_GDN)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_GDN, **_GDN_MOE)),
}
GDN_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def make_checkpoint(kind: str, root: Path, seed: int = 0, tokenizer=None, name: str | None = None,
                    logit_scale: float = 1.0, vary_vectors: bool = False, **overrides) -> Path:
    """`vary_vectors`: random biases (std 0.08) and norm weights (1 + std 0.2), so that a bias or a norm weight
    that went to the wrong place shows (transformers initialises them to 0 and 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = {**CONFIGS, **MOE_CONFIGS, **MLA_MOE_CONFIGS, **KDA_CONFIGS, **DSA_CONFIGS,
                         **FAMILY_CONFIGS, **GDN_CONFIGS, **GEMMA4_CONFIGS}[kind]
    cfg = AutoConfig.for_model(model_type, **{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    if type(cfg) in AutoModelForCausalLM._model_mapping:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:  # not in the auto mapping (Mistral 4 in transformers 5.17): the model type's own class
        import transformers

        model = getattr(transformers, HF_CLASSES[model_type])(cfg).float()
    with torch.no_grad():  # larger weights than the default init give peakier, less tie-prone logits
        for p in model.parameters():
            if p.dim() >= 2:  # MoE experts are 3-D in memory
                p.normal_(0, 0.08)
            elif model_type == "gemma4_text":  # plain-weight norms, router scales: perturbed around 1
                p.normal_(1, 0.2)
            elif model_type.startswith("gemma"):  # Gemma norms scale by 1 + weight: make the weight matter
                p.normal_(0, 0.2)
            elif model_type in GDN_TYPES:  # (1 + w) norms, the gated norm, the GDN decay: perturbed around init
                p.add_(torch.randn_like(p) * 0.2)
        if vary_vectors:
            for pname, p in model.named_parameters():
                if p.dim() == 1 and pname.endswith(".bias"):
                    p.normal_(0, 0.08)
                elif p.dim() == 1 and "norm" in pname:
                    p.normal_(1, 0.2)
                elif pname.endswith(".sinks"):  # gpt-oss: sinks that take a real share of the softmax
                    p.normal_(0, 1.0)
        for buf_name, b in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):  # DeepSeek-V3 routing: a bias that changes the choice
                b.normal_(0, 0.05)
            elif buf_name.endswith("layer_scalar"):  # Gemma 4: each layer's output scaled
                b.uniform_(0.5, 1.5)
        # peakier next-token distributions keep bf16 rounding from flipping near-tied argmaxes (GPU tests)
        model.get_output_embeddings().weight.mul_(logit_scale)
    out = root / (name or kind)
    model.save_pretrained(out)
    (tokenizer or make_tokenizer()).save_pretrained(out)
    return out


# the released gpt-oss checkpoints' quantization_config
GPT_OSS_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def gpt_oss_mxfp4_checkpoint(root: Path, tokenizer=None, name: str = "gpt_oss_mxfp4", **overrides) -> Path:
    """The tiny gpt-oss checkpoint with its experts in the real checkpoints' MXFP4 format: each stacked expert
    weight ([E, in, out] in transformers' layout) as `*_blocks` [E, out, in / 32, 16] and `*_scales`
    [E, out, in / 32], and the released models' quantization_config."""
    import json

    from safetensors.torch import load_file, save_file

    from kestrel.kernels.mxfp4 import quantize_mxfp4

    path = make_checkpoint("gpt_oss", root, tokenizer=tokenizer, name=name, vary_vectors=True, **overrides)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks.contiguous(), scales.contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = GPT_OSS_MXFP4
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


# what a Kimi Linear engine holds in float32 whatever its dtype: the forget gate's parameters, the MoE router
KIMI_FLOAT32_PARAMS = ("A_log", "dt_bias", "gate.weight", "e_score_correction_bias")


def kimi_linear_bf16_checkpoint(root: Path, seed: int = 0, tokenizer=None, name: str | None = None) -> Path:
    """The bf16 comparisons' Kimi Linear: Kimi-Linear's KDA head size (2 heads x 128), peakier logits, decisive
    routers, and weights bf16 holds exactly (but KIMI_FLOAT32_PARAMS), so transformers in float32 on it is the
    exact model of what a bf16 engine loads: rounding the weights alone (transformers float32 on both) broke the
    teacher-forced agreement rule on 5 of 20 prompts x seeds (CPU)."""
    from tests.agreement import bf16_representable, decisive_routers

    lin = dict(KDA_CONFIGS["kimi_linear"][1]["linear_attn_config"], num_heads=2, head_dim=128)
    path = make_checkpoint("kimi_linear", root, seed=seed, tokenizer=tokenizer, name=name, hidden_size=256,
                           kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           linear_attn_config=lin, logit_scale=4.0)
    decisive_routers(path)
    bf16_representable(path, keep=KIMI_FLOAT32_PARAMS)
    return path


def qwen3_5_vl_checkpoint(root: Path, moe: bool = False, seed: int = 0, tokenizer=None) -> Path:
    """A tiny Qwen3_5(Moe)ForConditionalGeneration checkpoint: the text model of GDN_CONFIGS (weights perturbed as
    make_checkpoint does), a one-block vision tower with its image processor, and two `mtp.*` tensors (the MTP head
    real checkpoints carry, which transformers does not write)."""
    from safetensors.torch import load_file, save_file
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kind = "qwen3_5_moe" if moe else "qwen3_5"
    text = {**BASE, **GDN_CONFIGS[kind][1]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    ids = dict(image_token_id=VOCAB_SIZE - 4, video_token_id=VOCAB_SIZE - 3, vision_start_token_id=VOCAB_SIZE - 2,
               vision_end_token_id=VOCAB_SIZE - 1)
    config_cls, model_cls = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe else
                             (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    torch.manual_seed(seed)
    model = model_cls(config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    out = root / f"{kind}_vl"
    model.save_pretrained(out)
    (tokenizer or make_tokenizer()).save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2).save_pretrained(out)  # image models
    weights = load_file(out / "model.safetensors")
    weights.update({"mtp.fc.weight": torch.zeros(4, 4), "mtp.norm.weight": torch.zeros(4)})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


# what a GDN hybrid engine holds in float32 whatever its dtype: the decay's parameters
GDN_FLOAT32_PARAMS = ("A_log", "dt_bias")


def gdn_bf16_checkpoint(kind: str, root: Path, seed: int = 0, tokenizer=None, name: str | None = None) -> Path:
    """The GPU comparisons' GDN hybrid (`kind` of GDN_CONFIGS): Qwen3.5's head sizes (GDN: 2 key heads repeated to
    4 value heads, D_k = D_v = 128; attention heads of 256 with partial RoPE 0.25), peakier logits, decisive
    routers, weights bf16 holds exactly (but GDN_FLOAT32_PARAMS): transformers in float32 on it is the exact model
    of what a bf16 engine loads."""
    from tests.agreement import bf16_representable, decisive_routers

    path = make_checkpoint(kind, root, seed=seed, tokenizer=tokenizer, name=name, hidden_size=256, head_dim=256,
                           linear_key_head_dim=128, linear_value_head_dim=128, logit_scale=4.0)
    decisive_routers(path)
    bf16_representable(path, keep=GDN_FLOAT32_PARAMS)
    return path


def gemma4_vl_checkpoint(root: Path, seed: int = 0, tokenizer=None) -> Path:
    """A tiny Gemma4ForConditionalGeneration checkpoint: the E2B-like text model of GEMMA4_CONFIGS (weights perturbed
    as make_checkpoint does), a one-layer vision tower and a one-layer audio tower, for the text-part loader."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {**BASE, **GEMMA4_CONFIGS["gemma4_e2b"][1]}
    text.pop("tie_word_embeddings")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32)
    ids = dict(boi_token_id=VOCAB_SIZE - 7, eoi_token_id=VOCAB_SIZE - 6, image_token_id=VOCAB_SIZE - 5,
               video_token_id=VOCAB_SIZE - 4, boa_token_id=VOCAB_SIZE - 3, eoa_token_index=VOCAB_SIZE - 2,
               audio_token_id=VOCAB_SIZE - 1)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=audio,
                                                        **ids)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.normal_(1, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    out = root / "gemma4_vl"
    model.save_pretrained(out)
    (tokenizer or make_tokenizer()).save_pretrained(out)
    return out

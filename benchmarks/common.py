"""Shared pieces of the benchmarks: model shapes, the workload, ceilings (copy bandwidth, bf16 matmul rate),
and the markdown table printer."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    # Qwen3-0.6B: hidden 1024, 28 layers, 16 heads / 8 KV heads, head dim 128, MLP 3072, vocab 151936, tied
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645),
    # Llama-3.1-8B: hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocab 128256, untied, llama3 rope
    "llama-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                     vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192},
                     bos_token_id=128000, eos_token_id=128009),
    # Llama-3.1-70B: hidden 8192, 80 layers, 64 heads / 8 KV heads, MLP 28672, vocab 128256, untied, llama3 rope
    # (141 GB of bf16 weights: tensor parallel 4 or 8)
    "llama-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=28672,
                      vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      bos_token_id=128000, eos_token_id=128009),
    # Gemma-3-1B (text): hidden 1152, 26 layers (5 of every 6 sliding, window 512), 4 heads / 1 KV head, head dim
    # 256, MLP 6912 (GeLU-tanh), vocab 262144, tied
    "gemma3-1b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=512,
                      query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", rope_theta=1000000.0,
                      rope_local_base_freq=10000.0, bos_token_id=2, eos_token_id=1),
    # Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads / 4 KV heads, head dim 128, 128 experts of 768, top-8
    # (renormalized), every layer sparse, vocab 151936, untied
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                          tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645),
    # gpt-oss-20b: hidden 2880, 24 layers alternating sliding (128) and full attention with sinks, 64 heads / 8 KV
    # heads of 64, q/k/v/o bias, YaRN x32 over 4096; 32 experts of 2880 (biases, clamped SwiGLU), top-4; vocab
    # 201088. Random weights in bf16 (the released checkpoint's MXFP4 experts are dequantised to this on load).
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
                        vocab_size=201088, tie_word_embeddings=False, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, swiglu_limit=7.0, rope_parameters={
                            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
                        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999),
    # DeepSeek-V2-Lite: hidden 2048, 27 layers, 16 heads, MLA (latent 512 + rope 64 a token and layer; qk 128 + 64,
    # v 128, no q compression), YaRN x40; layer 0 dense (MLP 10944), then MoE (64 routed experts of 1408, top-6,
    # 2 shared); vocab 102400. The same config as /work/shared/peers/vllm/vllm_shapes.py's.
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
                             num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, moe_layer_freq=1,
                             routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
                             scoring_func="softmax", norm_topk_prob=False, vocab_size=102400,
                             tie_word_embeddings=False, max_position_embeddings=163840, rms_norm_eps=1e-6,
                             rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40,
                                                             "original_max_position_embeddings": 4096,
                                                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                                             "mscale_all_dim": 0.707},
                             bos_token_id=100000, eos_token_id=100001),
}
# DSA-shaped V2-Lite (issue 34): V2-Lite's dims plus q compression (1536, as DeepSeek-V2/V3) and a 64 x 128 lightning
# indexer with index_topk 2048, on DeepSeek-V3.2's classes (V3's sigmoid router); its twin with dense MLA is the
# same shape on DeepseekV3ForCausalLM (no indexer)
_V2_LITE_DSA = {k: v for k, v in SHAPES["deepseek-v2-lite"].items()
                if k not in ("topk_method", "scoring_func", "moe_layer_freq", "rope_scaling", "rope_theta")}
_V2_LITE_DSA.update(q_lora_rank=1536, rope_parameters={
    "rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
    "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000})
SHAPES["deepseek-v2-lite-dsa"] = dict(_V2_LITE_DSA, architectures=["DeepseekV32ForCausalLM"],
                                      model_type="deepseek_v32", index_n_heads=64, index_head_dim=128,
                                      index_topk=2048)
SHAPES["deepseek-v2-lite-dsa-dense"] = dict(_V2_LITE_DSA, architectures=["DeepseekV3ForCausalLM"],
                                            model_type="deepseek_v3", rope_interleave=True)
# V2-Lite's attention with every layer dense (the 10944 MLP of its layer 0; its MoE layers touch 8 x 1408 = 11264
# columns a token): MLA measured without the MoE kernels
SHAPES["deepseek-v2-lite-dense"] = {**SHAPES["deepseek-v2-lite"], "first_k_dense_replace": 27}
# Llama-3.1-8B with 4-bit weights (issue 54), as AutoAWQ / GPTQModel write their configs (group 128); with
# --load-format dummy the integer tensors stay zero and the scales are random (speed does not depend on values)
SHAPES["llama-8b-awq"] = {**SHAPES["llama-8b"], "quantization_config": {
    "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
    "modules_to_not_convert": None}}
SHAPES["llama-8b-gptq"] = {**SHAPES["llama-8b"], "quantization_config": {
    "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
    "checkpoint_format": "gptq"}}
# Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct config.json, via transformers' KimiLinearConfig):
# 27 layers, KDA at 1-indexed [1, 2, 3, 5, ...], NoPE MLA at [4, 8, ..., 24, 27]; KDA 32 heads x 128, conv width
# 4; 256 experts of 1024, top-8, 1 shared expert, layer 1 dense (9216)
SHAPES["kimi-linear-48b"] = dict(
    architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", hidden_size=2304, num_hidden_layers=27,
    num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, intermediate_size=9216, moe_intermediate_size=1024, num_experts=256,
    num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1, moe_renormalize=True,
    routed_scaling_factor=2.446, num_expert_group=1, topk_group=1, vocab_size=163840, tie_word_embeddings=False,
    model_max_length=1048576, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=163584, eos_token_id=163586,
    pad_token_id=163839, linear_attn_config={
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
        "short_conv_kernel_size": 4})

# Qwen3.6-35B-A3B (the text model of Qwen/Qwen3.6-35B-A3B; Qwen3.5-35B-A3B has the same dims): 40 layers, 10 x (3
# Gated DeltaNet + 1 gated attention); GDN 16 q/k heads read by 32 value heads, 128 x 128, conv width 4; attention
# 16 heads / 2 KV heads of 256, partial RoPE 0.25 (64 dims); 256 experts of 512, top-8 (renormalised) + a gated
# shared expert of 512 on every layer; vocab 248320, untied
SHAPES["qwen3.6-35b-a3b"] = dict(
    architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320,
    tie_word_embeddings=False, max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    bos_token_id=248044, eos_token_id=248046)

# Gemma-4-26B-A4B (google/gemma-4-26B-A4B-it's text model, from public copies of its config): 30 layers, 5 of every
# 6 sliding (window 1024; 16 heads / 8 KV heads of 256), the others global (2 KV heads of 512, K = V, proportional
# RoPE 0.25); a 2112 GeLU-tanh MLP beside 128 experts of 704, top-8; vocab 262144, tied, final soft-cap 30
SHAPES["gemma4-26b-a4b"] = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_size=2816, num_hidden_layers=30,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)],
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
    attention_k_eq_v=True, sliding_window=1024, intermediate_size=2112, enable_moe_block=True, num_experts=128,
    top_k_experts=8, moe_intermediate_size=704, hidden_size_per_layer_input=0, vocab_size=262144,
    tie_word_embeddings=True, max_position_embeddings=262144, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0)


def write_shape(name: str) -> Path:
    """A folder with only config.json: loaded with load_format='dummy' (random weights)."""
    d = Path(tempfile.mkdtemp(prefix=f"kestrel-{name}-"))
    (d / "config.json").write_text(json.dumps({**SHAPES[name], "torch_dtype": "bfloat16"}))
    return d


@dataclass
class ShapeFacts:
    params: int
    weight_bytes: int  # every weight a step can read (MoE: all experts)
    kv_bytes_per_token: int
    flops_per_token: int  # 2 * params touched per token (matmuls), without attention
    expert_bytes: int = 0  # MoE: one expert of every layer
    num_experts: int = 0
    top_k: int = 0
    state_bytes_per_seq: int = 0  # a recurrent-state model (KDA): the state each decode step reads and writes

    def active_weight_bytes(self, batch: float = 1) -> float:
        """The roofline's bytes per step: the weights a step of `batch` tokens reads. MoE: the dense part plus the
        experts expected to be hit (each of E experts is missed by all of batch * top-k uniform picks with
        probability (1 - k/E)^batch)."""
        if not self.num_experts:
            return self.weight_bytes
        hit = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        return self.weight_bytes - (self.num_experts - hit) * self.expert_bytes


def shape_facts(name: str, dtype_bytes: int = 2) -> ShapeFacts:
    s = SHAPES[name]
    if "linear_attn_config" in s:
        return _kimi_linear_shape_facts(s, dtype_bytes)
    if "linear_num_value_heads" in s:
        return _gdn_shape_facts(s, dtype_bytes)
    if "kv_lora_rank" in s:
        return _mla_shape_facts(s, dtype_bytes)
    if s.get("model_type") == "gemma4_text":
        return _gemma4_shape_facts(s, dtype_bytes)
    h, L, nh, kvh, hd, inter, V = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                                   s["num_key_value_heads"], s["head_dim"], s["intermediate_size"], s["vocab_size"])
    attn = h * (nh + 2 * kvh) * hd + nh * hd * h
    e, k = s.get("num_experts", s.get("num_local_experts", 0)), s.get("num_experts_per_tok", 0)
    if e:  # every layer sparse (the shapes here): router + experts (gpt-oss: experts of intermediate_size)
        expert = 3 * h * s.get("moe_intermediate_size", inter)
        per_layer, active_layer = attn + e * h + e * expert, attn + e * h + k * expert
    else:
        expert, per_layer, active_layer = 0, attn + 3 * h * inter, attn + 3 * h * inter
    emb = V * h
    params = L * per_layer + emb * (1 if s["tie_word_embeddings"] else 2)
    matmul_params = L * active_layer + emb  # the lm_head is a matmul, the embedding lookup is not
    return ShapeFacts(params, (L * per_layer + emb) * dtype_bytes, 2 * L * kvh * hd * dtype_bytes, 2 * matmul_params,
                      L * expert * dtype_bytes, e, k)


def _mla_shape_facts(s: dict, dtype_bytes: int) -> ShapeFacts:
    """MLA (DeepSeek): the cache holds one latent (kv_lora_rank + rope) a token and layer; MoE layers count the
    experts a token touches for FLOPs and all experts for weight bytes."""
    h, L, nh, V = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["vocab_size"]
    rank, rope, nope, vd, ql = (s["kv_lora_rank"], s["qk_rope_head_dim"], s["qk_nope_head_dim"], s["v_head_dim"],
                                s.get("q_lora_rank"))
    q = h * ql + ql * nh * (nope + rope) if ql else h * nh * (nope + rope)
    attn = q + h * (rank + rope) + rank * nh * (nope + vd) + nh * vd * h
    index_dim, index_heads = s.get("index_head_dim", 0), s.get("index_n_heads", 0)  # DSA's lightning indexer
    attn += ql * index_heads * index_dim + h * (index_dim + index_heads) if index_dim else 0
    dense = L if not s.get("n_routed_experts") else min(L, s.get("first_k_dense_replace", 0))
    mlp_dense = 3 * h * s["intermediate_size"]
    moe_all = 3 * h * s.get("moe_intermediate_size", 0) * (s.get("n_routed_experts", 0) + s.get("n_shared_experts", 0))
    moe_active = 3 * h * s.get("moe_intermediate_size", 0) * (s.get("num_experts_per_tok", 0) +
                                                               s.get("n_shared_experts", 0))
    emb = V * h
    all_params = L * attn + dense * mlp_dense + (L - dense) * moe_all
    active = L * attn + dense * mlp_dense + (L - dense) * moe_active
    params = all_params + emb * (1 if s["tie_word_embeddings"] else 2)
    expert = (L - dense) * 3 * h * s.get("moe_intermediate_size", 0) * dtype_bytes
    return ShapeFacts(params, (all_params + emb) * dtype_bytes, L * (rank + rope + index_dim) * dtype_bytes,
                      2 * (active + emb),
                      expert if s.get("n_routed_experts") else 0, s.get("n_routed_experts", 0),
                      s.get("num_experts_per_tok", 0) or 0)


def _kimi_linear_shape_facts(s: dict, dtype_bytes: int) -> ShapeFacts:
    """Kimi Linear: KDA layers (q|k|v|gates in-projection, the gates' up-projections, o_proj, a short convolution;
    a float32 recurrent state per request instead of a KV cache) and NoPE MLA layers (one latent a token); MoE
    after the first dense layers, with shared experts."""
    h, L, nh, V = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["vocab_size"]
    lin = s["linear_attn_config"]
    n_kda, kh, kd, width = len(lin["kda_layers"]), lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    hd = kh * kd
    kda = h * (3 * hd + 2 * kd + kh) + 2 * kd * hd + hd * h + 3 * hd * width
    rank, rope, nope, vd = s["kv_lora_rank"], s["qk_rope_head_dim"], s["qk_nope_head_dim"], s["v_head_dim"]
    mla = h * nh * (nope + rope) + h * (rank + rope) + rank * nh * (nope + vd) + nh * vd * h
    n_mla, dense = L - n_kda, s["first_k_dense_replace"]
    e, k, shared = s["num_experts"], s["num_experts_per_token"], s["num_shared_experts"]
    expert = 3 * h * s["moe_intermediate_size"]
    attn = n_kda * kda + n_mla * mla + dense * 3 * h * s["intermediate_size"]
    all_params = attn + (L - dense) * (e * h + (e + shared) * expert)
    active = attn + (L - dense) * (e * h + (k + shared) * expert)
    emb = V * h
    state = n_kda * (kh * kd * kd * 4 + 3 * hd * (width - 1) * dtype_bytes)
    return ShapeFacts(all_params + emb * (1 if s["tie_word_embeddings"] else 2), (all_params + emb) * dtype_bytes,
                      n_mla * (rank + rope) * dtype_bytes, 2 * (active + emb), (L - dense) * expert * dtype_bytes,
                      e, k, state)


def _gdn_shape_facts(s: dict, dtype_bytes: int) -> ShapeFacts:
    """The Gated DeltaNet hybrids (Qwen3.5-MoE): GDN layers (q|k|v|z|b|a in-projection, out_proj, a short
    convolution over q|k|v; a float32 recurrent state per request instead of a KV cache) and gated attention
    layers (q_proj doubled for the gate); an MoE block with a gated shared expert on every layer."""
    h, L, V = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    n_gdn = sum(t == "linear_attention" for t in s["layer_types"])
    hk, hv, dk, dv = (s["linear_num_key_heads"], s["linear_num_value_heads"], s["linear_key_head_dim"],
                      s["linear_value_head_dim"])
    conv, width = 2 * hk * dk + hv * dv, s["linear_conv_kernel_dim"]
    gdn = h * (conv + hv * dv + 2 * hv) + hv * dv * h + conv * width
    nh, kvh, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    attn = h * (2 * nh + 2 * kvh) * hd + nh * hd * h
    e, k = s["num_experts"], s["num_experts_per_tok"]
    expert, shared = 3 * h * s["moe_intermediate_size"], 3 * h * s["shared_expert_intermediate_size"]
    mixers = n_gdn * gdn + (L - n_gdn) * attn
    all_params = mixers + L * (e * h + h + e * expert + shared)
    active = mixers + L * (e * h + h + k * expert + shared)
    emb = V * h
    state = n_gdn * (hv * dk * dv * 4 + conv * (width - 1) * dtype_bytes)
    return ShapeFacts(all_params + emb * (1 if s["tie_word_embeddings"] else 2), (all_params + emb) * dtype_bytes,
                      2 * (L - n_gdn) * kvh * hd * dtype_bytes, 2 * (active + emb), L * expert * dtype_bytes, e, k,
                      state)


def _gemma4_shape_facts(s: dict, dtype_bytes: int) -> ShapeFacts:
    """Gemma 4: head shapes per layer type (global layers: global_head_dim, num_global_key_value_heads, no v_proj
    where K = V), the MoE block beside the dense MLP, per-layer inputs; layers that read another layer's cache
    (num_kv_shared_layers) have no k/v projections and keep no KV. The KV bytes count every caching layer at every
    token (the sliding layers hold at most their window: an upper bound past it)."""
    h, L, V, nh = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"], s["num_attention_heads"]
    first_shared = L - s.get("num_kv_shared_layers", 0)
    attn = kv = mlp = 0
    for i, kind in enumerate(s["layer_types"]):
        full = kind == "full_attention"
        hd = s["global_head_dim"] if full else s["head_dim"]
        kvh = (s.get("num_global_key_value_heads") or s["num_key_value_heads"]) if full and s.get(
            "attention_k_eq_v") else s["num_key_value_heads"]
        kv_parts = 0 if i >= first_shared else 1 if full and s.get("attention_k_eq_v") else 2
        attn += h * nh * hd * 2 + h * kvh * hd * kv_parts
        kv += 2 * kvh * hd * dtype_bytes if i < first_shared else 0
        wide = 2 if s.get("use_double_wide_mlp") and i >= first_shared > 0 else 1
        mlp += 3 * h * s["intermediate_size"] * wide
    e, k = (s["num_experts"], s["top_k_experts"]) if s.get("enable_moe_block") else (0, 0)
    expert = 3 * h * s["moe_intermediate_size"] if e else 0
    p = s.get("hidden_size_per_layer_input", 0)
    ple = L * 2 * h * p + h * L * p  # each layer's gate and projection; the projection of the embeddings
    dense = attn + mlp + L * e * h + ple
    emb = V * h
    ple_table = s.get("vocab_size_per_layer_input", V) * L * p
    params = dense + L * e * expert + emb * (1 if s["tie_word_embeddings"] else 2) + ple_table
    return ShapeFacts(params, (dense + L * e * expert + emb + ple_table) * dtype_bytes, kv,
                      2 * (dense + L * k * expert + emb), L * expert * dtype_bytes, e, k)


def nano_workload(n: int = 256, seed: int = 0, in_range=(100, 1024), out_range=(100, 1024), vocab_cap=10000):
    """nano-vllm's bench: random token ids < 10000, uniform prompt and output lengths, ignore_eos."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab_cap - 1) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    outs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outs


def measure_ceilings() -> dict:
    import torch

    x = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 2 * 10 / (time.perf_counter() - t)  # bytes read + written
    # a read-only stream (decode attention mostly reads) runs faster than a copy: report it beside the copy rate,
    # the roofline keeps the copy rate so figures stay comparable with earlier runs
    for _ in range(3):
        x.sum(dtype=torch.float32)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        x.sum(dtype=torch.float32)
    torch.cuda.synchronize()
    read_bw = x.numel() * 2 * 10 / (time.perf_counter() - t)
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 10 / (time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()  # tensor-parallel workers started after this size their KV cache from free memory
    return {"copy_bytes_per_s": bw, "read_bytes_per_s": read_bw, "bf16_flops_per_s": flops}


def git_commit() -> str:
    import os

    if os.environ.get("KESTREL_COMMIT"):  # the device machine gets the tree without .git
        return os.environ["KESTREL_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def print_table(title: str, rows: list[dict], digits: int = 1) -> None:
    """A markdown table; floats with `digits` decimals."""
    if not rows:
        return
    cols = list(dict.fromkeys(c for r in rows for c in r))  # every row's columns, first seen first
    print(f"\n### {title}\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        values = (r.get(c, "") for c in cols)
        print("| " + " | ".join(f"{v:,.{digits}f}" if isinstance(v, float) else str(v) for v in values) + " |")
    sys.stdout.flush()

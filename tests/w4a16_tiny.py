"""Tiny Llama / Qwen3 checkpoints whose linear layers are 4-bit (GPTQ, AWQ, compressed-tensors pack-quantized) or
W8A8 INT8 (compressed-tensors int-quantized), each beside its reference twin: the same model with every quantized
weight replaced by its dequantised value in float32 (which transformers runs).

compressed-tensors checkpoints are compressed and decompressed by compressed-tensors itself. GPTQ and AWQ have no
CPU packer in transformers: the packers here follow the formats' published layouts, written independently of
Kestrel's unpacking (plain Python bit arithmetic), and are checked against hand-computed words
(tests/kernels/test_w4a16.py):

* GPTQ (AutoGPTQ v1): qweight int32 [K/8, N], word (i, n) = sum_j u[n, 8i + j] << 4j; qzeros int32 [K/G, N/8],
  word (g, c) = sum_j ((zero[8c + j] - 1) & 15) << 4j; scales fp16 [K/G, N]; g_idx int32 [K].
  w = (u - zero) * scale (in fp16).
* AWQ (AutoAWQ GEMM): qweight int32 [K, N/8], word (k, c) = sum_i u[8c + ORDER[i], k] << 4i with ORDER =
  (0, 2, 4, 6, 1, 3, 5, 7); qzeros int32 [K/G, N/8] in the same order; scales fp16 [K/G, N].
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from tests.tiny import make_checkpoint

# every projection of a decoder layer (attention incl. MLA's q_a / q_b / kv_a / kv_b, MLP); not norms, embeddings,
# lm_head
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_(proj|mqa)\.weight")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ------------------------------------------------------------------------------------------------ quantizers
def gptq_groups(k: int, group: int, act_order: bool, seed: int = 0) -> torch.Tensor:
    """g_idx [K]: column perm[j] is in group j // G (act-order: a random column order, as desc_act's)."""
    g = group if group != -1 else k
    if not act_order:
        return (torch.arange(k) // g).to(torch.int32)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    return g_idx


def quantize_4bit(w: torch.Tensor, g_idx: torch.Tensor, symmetric: bool, bits: int = 4):
    """(u uint8 [N, K] in 0..2^bits - 1, zeros int [N, groups], fp16 scales [N, groups]): min-max per (row,
    group)."""
    maxq = 2 ** bits - 1
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    u = torch.empty(n, k, dtype=torch.uint8)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    scales = torch.empty(n, groups, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols].float()
        if symmetric:  # GPTQ sym: zero (maxq + 1) / 2, scale 2 * amax / maxq
            s = (2 * wg.abs().amax(-1) / maxq).clamp(min=1e-5).half()
            z = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
            s = ((hi - lo) / maxq).clamp(min=1e-5).half()
            z = torch.round(-lo / s.float()).clamp(0, maxq).long()
        u[:, cols] = torch.clamp(torch.round(wg / s.float()[:, None]) + z[:, None], 0, maxq).to(torch.uint8)
        zeros[:, g], scales[:, g] = z, s
    return u, zeros, scales


def dequantize_4bit(u, zeros, scales, g_idx) -> torch.Tensor:
    """The published formula, in the scales' dtype (fp16) as the formats' libraries compute it."""
    g = g_idx.long()
    return (u.long() - zeros[:, g]).to(scales.dtype) * scales[:, g]


# ------------------------------------------------------------------------------------------------ packers
def _word(values, bits: int = 4) -> int:
    v = 0
    for i, x in enumerate(values):
        v |= (int(x) & ((1 << bits) - 1)) << (bits * i)
    return v - (1 << 32) if v >= 1 << 31 else v


def gptq_pack(u, zeros, scales, g_idx, bits: int = 4) -> dict[str, torch.Tensor]:
    """`bits` 8: four values a word, the same order."""
    n, k = u.shape
    pf = 32 // bits
    ul, zl = u.tolist(), zeros.tolist()
    qweight = [[_word((ul[c][pf * i + j] for j in range(pf)), bits) for c in range(n)] for i in range(k // pf)]
    qzeros = [[_word((zl[pf * c + j][g] - 1 for j in range(pf)), bits) for c in range(n // pf)]
              for g in range(zeros.shape[1])]
    return {"qweight": torch.tensor(qweight, dtype=torch.int32), "qzeros": torch.tensor(qzeros, dtype=torch.int32),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def awq_pack(u, zeros, scales) -> dict[str, torch.Tensor]:
    n, k = u.shape
    ul, zl = u.tolist(), zeros.tolist()
    qweight = [[_word(ul[8 * c + AWQ_ORDER[i]][r] for i in range(8)) for c in range(n // 8)] for r in range(k)]
    qzeros = [[_word(zl[8 * c + AWQ_ORDER[i]][g] for i in range(8)) for c in range(n // 8)]
              for g in range(zeros.shape[1])]
    return {"qweight": torch.tensor(qweight, dtype=torch.int32), "qzeros": torch.tensor(qzeros, dtype=torch.int32),
            "scales": scales.t().contiguous()}


# ------------------------------------------------------------------------------------------------ compressed-tensors
def ct_scheme(kind: str, group: int | None = 32):
    from compressed_tensors.quantization import QuantizationScheme

    if kind in ("w4a16", "w4a16_asym"):
        return QuantizationScheme(targets=["Linear"], weights={
            "num_bits": 4, "type": "int", "symmetric": kind == "w4a16", "strategy": "group" if group else "channel",
            "group_size": group, "dynamic": False})
    return QuantizationScheme(targets=["Linear"], weights={
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True})


def ct_compress(w: torch.Tensor, kind: str, group: int | None = 32, scale_dtype: torch.dtype = torch.bfloat16):
    """(compressed tensors, compressed-tensors' decompression of them): scales amax / 7 or amax / 127 (bf16 by
    default, as llm-compressor writes them for a bf16 model)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    scheme = ct_scheme(kind, group)
    tensors = {"weight": w}
    if kind == "w4a16":
        g = w.float().unflatten(-1, (-1, group or w.shape[1]))
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-6).to(scale_dtype)
        comp = PackedQuantizationCompressor
    elif kind == "w4a16_asym":  # min-max: zero points in -8..7 (stored + 8)
        g = w.float().unflatten(-1, (-1, group or w.shape[1]))
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).to(scale_dtype)
        tensors["weight_zero_point"] = (torch.round(-lo / scale.float()) - 8).clamp(-8, 7).to(torch.int8)
        comp = PackedQuantizationCompressor
    else:
        scale = (w.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6).to(scale_dtype)
        comp = IntQuantizationCompressor
    out = comp.compress({**tensors, "weight_scale": scale}, scheme)
    return out, comp.decompress(dict(out), scheme)["weight"]


def ct_act_order(w: torch.Tensor, group: int, g_idx: torch.Tensor):
    """compressed-tensors W4A16 with actorder "group" (this library version packs but does not quantize with a
    g_idx): symmetric q in -8..7 per (row, group of g_idx), packed by compressed-tensors' pack_to_int32, fp16
    scales, `weight_g_idx`; and the dequantised weight q * scale (fp16)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    u, zeros, scales = quantize_4bit(w, g_idx, symmetric=True)
    q = (u.to(torch.int16) - 8).to(torch.int8)
    tensors = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scales, "weight_shape": torch.tensor(w.shape),
               "weight_g_idx": g_idx.to(torch.int32)}
    return tensors, dequantize_4bit(u, zeros, scales, g_idx)


def ct_quantization_config(kind: str, group: int | None = 32, act_order: bool = False) -> dict:
    scheme = ct_scheme(kind, group).model_dump()
    scheme.pop("format", None)
    if act_order:
        scheme["weights"]["actorder"] = "group"
    return {"quant_method": "compressed-tensors", "format": "int-quantized" if kind == "int8" else "pack-quantized",
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"], "quantization_status": "compressed",
            "kv_cache_scheme": None}


# ------------------------------------------------------------------------------------------------ checkpoints
def quantized_checkpoints(fmt: str, root: Path, kind: str = "llama", group: int | None = 32, act_order: bool = False,
                          tokenizer=None, seed: int = 0, bits: int = 4, **overrides) -> tuple[Path, Path]:
    """(the quantized checkpoint, its dequantised float32 twin). fmt: gptq, awq, ct_w4a16, ct_w4a16_asym,
    ct_int8."""
    from safetensors.torch import load_file, save_file

    tag = f"{fmt}{bits if bits != 4 else ''}_{kind}_g{group}{'_act' if act_order else ''}"
    ref = make_checkpoint(kind, root, seed=seed, tokenizer=tokenizer, name=f"{tag}_ref", **overrides)
    (file,) = ref.glob("*.safetensors")
    weights, quant = load_file(file), {}
    for i, name in enumerate(sorted(n for n in weights if LINEAR.fullmatch(n))):
        w, base = weights[name], name[:-len("weight")]
        if fmt == "ct_w4a16" and act_order:
            tensors, deq = ct_act_order(w, group, gptq_groups(w.shape[1], group, True, seed=i))
        elif fmt.startswith("ct_"):
            tensors, deq = ct_compress(w, fmt[3:], group)
        else:
            g_idx = gptq_groups(w.shape[1], group, act_order, seed=i) if fmt == "gptq" else \
                gptq_groups(w.shape[1], group, False)
            u, zeros, scales = quantize_4bit(w, g_idx, symmetric=fmt == "gptq", bits=bits)
            tensors = gptq_pack(u, zeros, scales, g_idx, bits) if fmt == "gptq" else awq_pack(u, zeros, scales)
            deq = dequantize_4bit(u, zeros, scales, g_idx)
        quant.update({base + k: v for k, v in tensors.items()})
        weights[name] = deq.float()
    save_file(weights, file, metadata={"format": "pt"})
    out = root / tag
    shutil.copytree(ref, out)
    save_file({**{n: t for n, t in weights.items() if not LINEAR.fullmatch(n)}, **quant}, out / file.name,
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group, act_order, bits)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, ref


def quantization_config(fmt: str, group: int | None, act_order: bool = False, bits: int = 4) -> dict:
    if fmt == "gptq":  # as optimum / GPTQModel write it
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": True,
                "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq", "static_groups": False}
    if fmt == "awq":  # as AutoAWQ writes it
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    return ct_quantization_config(fmt[3:], group, act_order)

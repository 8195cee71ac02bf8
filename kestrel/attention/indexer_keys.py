"""FP8 keys for DSA's lightning indexer (`--indexer-key-dtype fp8`), as DeepSeek-V3.2's reference inference code
keeps them: each key is rotated by a Walsh-Hadamard transform, then stored as float8 e4m3 values with one float32
scale per token (a power of two: DeepSeek's ue8m0 scales), 128 + 4 = 132 bytes a token at index_head_dim 128
instead of 256 in bf16. The indexer query gets the same rotation and quantization, its per-(token, head) scale
folded into the head weights w (positive, so it commutes with the ReLU):

    I[t, s] = sum_h w[t, h] * q_scale[t, h] * ReLU(q8[t, h] . k8[s]) * k_scale[s]

The rotation is orthogonal (q.k = Hq.Hk): it changes no score in exact math, and spreads outlying dimensions
over all of them so that one scale per 128 values loses little. transformers' DeepseekV32Indexer does neither
(it scores in float32), so "bf16" (the keys in the model's dtype, unrotated) stays the default and is what the
CPU tests compare with transformers; "fp8" trades exactness for about half the indexer's bytes.

The spec carries the choice (SparseMLASpec.index_dtype); the impl (SparseMLAImpl.forward_sparse) rotates and
quantizes before the backend writes or scores, so backends only store and read (keys, scales)."""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from kestrel.core.kv_spec import KVCacheSpec, SparseMLASpec
from kestrel.errors import ConfigError
from kestrel.kernels.fp8_quant import quantize_per_token

INDEX_KEY_DTYPES = {"bf16": None, "fp8": torch.float8_e4m3fn}  # None: the model's dtype, unquantized
MAX_FP8_INDEX_DIM = 128  # one scale per key, over at most DeepSeek's 128-value block


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) times the normalized Walsh-Hadamard matrix H / sqrt(D), in float32: one
    matmul with the cached matrix (on the GPU one GEMM beats log2(D) butterfly passes over the queries)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two dim, got {d}")
    return x.float() @ _hadamard_matrix(d, x.device)


@functools.cache
def _hadamard_matrix(d: int, device: torch.device) -> torch.Tensor:
    """Sylvester's construction, H_2n = [[H, H], [H, -H]], scaled by d^-1/2 (symmetric and orthogonal)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * d ** -0.5).to(device, torch.float32)


def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [T, D] (after rotary) -> (float8 e4m3 [T, D], float32 scale [T, 1]) of the rotated key."""
    return quantize_per_token(hadamard_rotate(k), torch.float8_e4m3fn, power_of_two=True)


def quantize_index_queries(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (after rotary), w [T, H] float32 -> (float8 e4m3 [T, H, D] of the rotated query, w times each
    (token, head)'s scale)."""
    q8, scale = quantize_per_token(hadamard_rotate(q), torch.float8_e4m3fn, power_of_two=True)
    return q8, w.float() * scale[..., 0]


def dequantize_index_keys(keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(float8 [..., D], float32 [..., 1]) -> the rotated keys in float32."""
    return keys.float() * scales


def specs_with_index_key_dtype(specs: dict[str, KVCacheSpec], name: str) -> dict[str, KVCacheSpec]:
    """The layers' specs with DSA indexer keys in `name` ("bf16": unchanged; "fp8": SparseMLASpec pages keep
    float8 keys + a float32 scale per token). Other kinds are untouched (a model without DSA ignores the flag)."""
    if name not in INDEX_KEY_DTYPES:
        raise ConfigError(f"--indexer-key-dtype {name}: expected one of {', '.join(INDEX_KEY_DTYPES)}")
    dtype = INDEX_KEY_DTYPES[name]
    if dtype is None:
        return specs
    out = {}
    for layer, spec in specs.items():
        if isinstance(spec, SparseMLASpec):
            d = spec.index_head_dim
            if d & (d - 1) or d > MAX_FP8_INDEX_DIM:
                raise ConfigError(f"--indexer-key-dtype fp8: index_head_dim {d} (layer {layer}) must be a power "
                                  f"of two <= {MAX_FP8_INDEX_DIM} (one scale per key, a Hadamard rotation)")
            spec = replace(spec, index_dtype=dtype)
        out[layer] = spec
    return out

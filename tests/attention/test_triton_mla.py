"""Triton MLA: the absorbed decode kernel against the reference latent attention, and the whole Triton MLA backend
(absorbed decodes + dense prefill through the varlen Triton attention) against the expanded reference path.

The kernel tests run on CUDA, or on the CPU under the Triton interpreter (TRITON_INTERPRET=1, tiny shapes); the
backend test at DeepSeek-V2-Lite's dims, contexts up to 32k, is GPU-only: bf16 relative error norm < 1e-2."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

from kestrel.attention.backends.torch_mla import mla_latent_attention_ref, write_latent_ref  # noqa: E402
from kestrel.bench.mla_inputs import make_batch, make_layer, rel_err, run_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _decode_case(seq_lens, block_size, H, L, R, dtype, gen):
    nblk = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(nblk) + 1, generator=gen)
    bt = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    o = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[o:o + n]
        o += n
    cache = torch.randn(sum(nblk) + 1, block_size, L + R, generator=gen).to(DEVICE, dtype)
    q_lat = torch.randn(len(seq_lens), H, L, generator=gen).to(DEVICE, dtype)
    q_pe = torch.randn(len(seq_lens), H, R, generator=gen).to(DEVICE, dtype)
    return q_lat, q_pe, cache, bt.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16] + ([] if torch.cuda.is_available() else [torch.float32]))
@pytest.mark.parametrize("num_splits,cfg", [(1, None), (4, {"MIN_SPLIT": 16})])
def test_mla_decode_kernel_matches_reference(dtype, num_splits, cfg):
    from kestrel.attention.ops.triton_mla import mla_decode_attention

    gen = torch.Generator().manual_seed(0)
    H, L, R, bs = 20, 64, 16, 16  # 20 heads: two head blocks, the second partly masked
    seq_lens = [1, 37, 130, 0]  # 0: a padded CUDA-graph row (zeros out)
    q_lat, q_pe, cache, bt, sl = _decode_case(seq_lens, bs, H, L, R, dtype, gen)
    out = mla_decode_attention(q_lat, q_pe, cache, bt, sl, 0.1, num_splits=num_splits, _config=cfg)
    expect = mla_latent_attention_ref(q_lat.float(), q_pe.float(), cache.float(), bt, list(range(5)), seq_lens, 0.1)
    assert out[3].abs().max().item() == 0.0
    assert rel_err(out[:3], expect[:3]) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_write_latent_matches_reference():
    from kestrel.attention.ops.triton_mla import write_latent

    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(4, 16, 80, device=DEVICE)
    kv_c, k_pe = torch.randn(5, 64, generator=gen).to(DEVICE), torch.randn(5, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([3, 17, -1, 40, 63], device=DEVICE)
    expect = cache.clone()
    write_latent(kv_c, k_pe, cache, slots)
    write_latent_ref(kv_c, k_pe, expect, slots)
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_kv_matches_padded_scatter(dtype):
    """expand_kv against the torch expression it replaced (zeroed buffers, three index_put scatters): equal on
    every context row, keys whole (zero pad lanes included), values on their vd lanes; no other row written."""
    from kestrel.attention.ops.triton_mla import expand_kv

    gen = torch.Generator().manual_seed(2)
    H, nope, R, vd, D = 20, 32, 16, 24, 64  # 20 heads: two head blocks, the second partly masked
    kv = torch.randn(9, H, nope + vd, generator=gen).to(DEVICE, dtype)
    k_nope, v = kv.split([nope, vd], dim=-1)  # strided views, as expand_contexts gives them
    k_pe = torch.randn(9, 80, generator=gen).to(DEVICE, dtype)[:, 64:]  # the rope part of gathered latents
    rows = torch.tensor([0, 1, 2, 16, 17, 18, 19, 20, 32], device=DEVICE)  # block-aligned requests, gaps between
    expect_k, expect_v = torch.zeros(48, H, D, dtype=dtype, device=DEVICE), torch.zeros(48, H, D, dtype=dtype,
                                                                                         device=DEVICE)
    expect_k[rows, :, :nope] = k_nope
    expect_k[rows, :, nope:nope + R] = k_pe[:, None, :]
    expect_v[rows, :, :vd] = v
    k_out, v_out = torch.full_like(expect_k, 7.0), torch.full_like(expect_v, 7.0)
    expand_kv(k_nope, k_pe, v, rows, k_out, v_out)
    assert torch.equal(k_out[rows], expect_k[rows])
    assert torch.equal(v_out[rows, :, :vd], expect_v[rows, :, :vd])
    assert (v_out[rows, :, vd:] == 7).all()
    others = torch.ones(48, dtype=torch.bool, device=DEVICE)
    others[rows] = False
    assert (k_out[others] == 7).all() and (v_out[others] == 7).all()


def _backend_vs_expanded(reqs, dims, block_size):
    """The Triton backend's decodes (absorbed kernel) and prefill chunks (dense through the varlen Triton
    attention) against the float32 expanded reference on the same bf16 inputs."""
    from kestrel.attention.backends.torch_mla import TorchMLABackend
    from kestrel.attention.backends.triton_mla import TritonMLABackend

    layer = make_layer(**dims, dtype=torch.bfloat16, device=DEVICE)
    batch = make_batch(layer, reqs, block_size, torch.bfloat16, DEVICE)
    out, meta = run_backend(TritonMLABackend, layer, batch, block_size)
    n_dec = sum(q == 1 for q, _ in reqs)
    assert (meta.num_absorbed_reqs, meta.num_absorbed_tokens) == (n_dec, n_dec)
    ref_layer = make_layer(**dims, dtype=torch.float32, device=DEVICE)
    ref_layer.kv_b_proj.weight.copy_(layer.kv_b_proj.weight.float())
    ref_layer.process_weights_after_loading()
    f32 = (tuple(x.float() for x in batch[0]), batch[1].float(), *batch[2:])
    expect, _ = run_backend(TorchMLABackend, ref_layer, f32, block_size, as_decode=False)
    qsl = meta.query_start_loc_cpu
    for b, req in enumerate(reqs):
        assert rel_err(out[qsl[b]:qsl[b + 1]], expect[qsl[b]:qsl[b + 1]]) < 1e-2, (block_size, req)


def test_triton_mla_backend_matches_expanded_path_small():
    _backend_vs_expanded([(1, 1), (1, 300), (7, 40), (16, 16)], dict(heads=4, rank=64, rope=16, nope=32, v=24), 16)


def test_joined_query_is_a_view_of_the_projection():
    """The dense path's query: q_nope and q_pe split from one projection output go in as a view of it (no
    concatenation, no padding); separate tensors are concatenated."""
    from kestrel.attention.backends.triton_mla import joined

    q = torch.randn(5, 4, 48)
    q_nope, q_pe = q.split([32, 16], dim=-1)
    view = joined(q_nope[1:4], q_pe[1:4])
    assert view.data_ptr() == q[1].data_ptr() and torch.equal(view, q[1:4])
    apart = joined(q_nope, q_pe.clone())
    assert apart.data_ptr() != q.data_ptr() and torch.equal(apart, q)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_triton_mla_backend_matches_expanded_path(block_size):
    """DeepSeek-V2-Lite dims (16 heads, latent 512 + 64, qk 128 + 64, v 128), contexts up to 32k (split decode)."""
    reqs = [(1, 1), (1, 777), (1, 32768), (1, 4100), (37, 300), (64, 64)]
    _backend_vs_expanded(reqs, dict(heads=16, rank=512, rope=64, nope=128, v=128), block_size)

"""The Triton MLA dense (MHA) prefill path alone, one layer at DeepSeek-V2-Lite dims (16 heads, latent 512 + 64,
qk 128 + 64, v 128, bf16, page 16) on the GPU: TritonMLAImpl.attend_dense against the glue it replaced (zeroed
K/V buffers, three index_put scatters, the query concatenated and padded to 256, the output sliced and copied),
with the pieces of the new path timed on their own. Prints the error of the new output against the old one.

    python -m benchmarks.mla_prefill [--iters 20]"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kestrel.attention.backends.triton_mla import TritonMLABackend, dense_row_dim, joined
from kestrel.attention.ops.triton_attention import prefill_attention
from kestrel.attention.ops.triton_mla import expand_kv
from kestrel.bench.mla_inputs import make_batch, make_layer, rel_err

DIMS = dict(heads=16, rank=512, rope=64, nope=128, v=128)
PAGE = 16
CASES = [(16, 1024, 1024), (4, 4096, 4096), (16, 1024, 4096)]  # requests x (new tokens, context): 16k tokens


def old_attend_dense(impl, q_nope, q_pe, cache, meta, layer, out) -> None:
    """The path before expand_kv (git 0e2ea78), layer-for-layer as it ran."""
    k_nope, k_pe, v = impl.expand_contexts(cache, meta, layer)
    H, nope, R, vd = layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    d = dense_row_dim(layer)
    rows = meta.dense_num_blocks * PAGE
    kbuf = q_nope.new_zeros(rows, H, d)
    vbuf = q_nope.new_zeros(rows, H, d)
    r = meta.dense_ctx_rows
    kbuf[r, :, :nope] = k_nope
    kbuf[r, :, nope:nope + R] = k_pe.to(kbuf.dtype)[:, None, :]
    vbuf[r, :, :vd] = v
    q = F.pad(torch.cat([q_nope, q_pe], dim=-1), (0, d - nope - R))
    na, nr = meta.num_absorbed_reqs, meta.num_reqs
    qsl = meta.query_start_loc[na:nr + 1] - meta.num_absorbed_tokens
    qsl_cpu, sl_cpu = meta.query_start_loc_cpu, meta.seq_lens_cpu
    o = prefill_attention(q, kbuf.view(-1, PAGE, H, d), vbuf.view(-1, PAGE, H, d), meta.dense_block_table, qsl,
                          meta.dense_seq_lens, impl.scale,
                          max_query_len=max(qsl_cpu[b + 1] - qsl_cpu[b] for b in range(na, nr)),
                          max_seq_len=max(sl_cpu[na:nr]))
    out.copy_(o[..., :vd])  # forward_mla's out[na:n] = ...


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    layer = make_layer(**DIMS, dtype=torch.bfloat16, device="cuda")
    impl = TritonMLABackend.impl_cls(layer.num_heads, layer.head_dim, layer.scale, 1)
    print(f"{'reqs x (new, ctx)':<20} {'old ms':>7} {'new ms':>7} {'saved':>6} | {'expand':>7} {'expand_kv':>9} "
          f"{'attn':>6} {'27 layers saved':>15} {'rel err':>8}")
    for n, q_len, ctx in CASES:
        (q_nope, q_pe, _, _), cache, common_meta, bt, slots = make_batch(layer, [(q_len, ctx)] * n, PAGE,
                                                                           torch.bfloat16, "cuda")
        meta = TritonMLABackend.builder_cls(layer.kv_cache_spec, PAGE, cache.device).build(common_meta, bt, slots)
        out_new, out_old = q_nope.new_empty(n * q_len, 16, 128), q_nope.new_empty(n * q_len, 16, 128)
        new = lambda: impl.attend_dense(q_nope, q_pe, cache, meta, layer, out_new)  # noqa: E731
        old = lambda: old_attend_dense(impl, q_nope, q_pe, cache, meta, layer, out_old)  # noqa: E731
        new(), old()
        err = rel_err(out_new, out_old)
        t_new, t_old = time_ms(new, args.iters), time_ms(old, args.iters)
        # the new path's pieces: the expansion GEMM (with its gather), expand_kv, the attention
        k_nope, k_pe, v = impl.expand_contexts(cache, meta, layer)
        kbuf = q_nope.new_empty(meta.dense_num_blocks * PAGE, 16, 256)
        vbuf = torch.empty_like(kbuf)
        t_exp = time_ms(lambda: impl.expand_contexts(cache, meta, layer), args.iters)
        t_kv = time_ms(lambda: expand_kv(k_nope, k_pe, v, meta.dense_ctx_rows, kbuf, vbuf), args.iters)
        q = joined(q_nope, q_pe)
        assert q.data_ptr() == q_nope.data_ptr(), "the query should go in as a view"
        t_attn = time_ms(lambda: prefill_attention(
            q, kbuf.view(-1, PAGE, 16, 256), vbuf.view(-1, PAGE, 16, 256), meta.dense_block_table,
            meta.dense_query_start_loc, meta.dense_seq_lens, impl.scale, out=out_new,
            max_query_len=meta.dense_max_query_len, max_seq_len=meta.dense_max_seq_len), args.iters)
        print(f"{f'{n} x ({q_len}, {ctx})':<20} {t_old:>7.3f} {t_new:>7.3f} {t_old - t_new:>6.3f} | {t_exp:>7.3f} "
              f"{t_kv:>9.3f} {t_attn:>6.3f} {27 * (t_old - t_new):>15.2f} {err:>8.1e}")


if __name__ == "__main__":
    main()

"""DSA (sparse MLA) decode attention on the H200 against dense MLA, one layer of a DSA-shaped DeepSeek-V2-Lite
(16 heads, latent 512 + 64, a 64 x 128 indexer, index_topk 2048, bf16, page 16), by kernel timing (CUDA-graph
replay): indexer scores over the paged key cache + top-k + sparse absorbed attention, against triton_mla's dense
decode over the whole context, at batch 1 and 64 and contexts 8k and 32k. Bytes a token and layer: latent 1,152,
indexer key 256 (bf16) or 132 (--indexer-key-dtype fp8: Hadamard-rotated float8 e4m3 + a float32 scale, fp8
queries with their scales in the head weights; the rotation and quantization of the step's own query and key
are not in the timing, as the bf16 column has no key write either). Both key formats are timed in one run.
Columns: the dense decode; the scores, torch.topk on them, the radix-select top-k (triton_topk.py) as one program a
row ("radix 1p", the kernel before the split one) and as radix_plan chooses ("radix", with its plan "P": programs
a row x BLOCK, "1p" where it keeps one program), the sparse attention with the first-guess tile and split rule
("sp old": 64-token tiles, on 4 warps above 16 tokens, which spill; splits of at least 256 selected tokens) and
with today's (default_sparse_config, sparse_num_splits; "splits": old/new counts); the DSA
total (torch.topk, select_topk's default, and today's sparse attention); its speedup and byte ceiling over dense
("w/ radix": the speedup with the planned radix top-k in the total; "graph": the speedup of the CUDA-graph decode
path, select_topk(static_width=True) at a 128k-wide score row: visible scores only and the radix top-k reading
each row's length on the device). Every case also checks that the planned radix top-k writes the one-program
kernel's very output (a line starting "MISMATCH" where not).

    python -m benchmarks.dsa_decode [--iters 50] [--e2e] [--indexer-key-dtype bf16|fp8|both] [--sweep]
--sweep: after the table, the sparse attention at every split count (three tiles) and the radix top-k at every
programs-per-row count (and three BLOCKs), per batch and context, the best of each marked with *: what to set
sparse_num_splits and radix_plan to, if the table's choices are not the best. Also the indexer scores by grid
(one tile a program, the eager default, or the CUDA-graph path's few programs striding over the row, each
loading and converting its query once) and, with FP8 keys, by dot (float16 after one packed convert, the
default, or the float8 tiles straight into the FP8 MMA: _fp8_dot). And the scores + radix top-k (select_topk, eager
and the CUDA-graph path) with the select's first histogram pass made by the scores kernel (first_pass_in_scores:
one read of the row and, split, one launch less) or not.
--e2e: also the whole engine on the random-weight shapes deepseek-v2-lite-dsa and its dense twin
deepseek-v2-lite-dsa-dense (benchmarks/common.py), 8 requests of 32k-token prompts: the decode steps' output
tokens per second of each, with the decode-graph replays counted (the 256-request short-context workload:
python -m benchmarks.throughput --shape deepseek-v2-lite-dsa, and --shape deepseek-v2-lite-dsa-dense)."""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.mla_decode import time_us
from kestrel.attention.backends.torch_sparse_mla import request_of_tokens, select_topk_ref, sparse_mla_attention_ref
from kestrel.attention.indexer_keys import dequantize_index_keys, quantize_index_keys, quantize_index_queries
from kestrel.attention.ops.triton_mla import mla_decode_attention
from kestrel.attention.ops.triton_attention import _sms_for
from kestrel.attention.ops.triton_sparse_mla import (indexer_scores, select_topk, sparse_mla_attention,
                                                     sparse_num_splits)
from kestrel.attention.ops.triton_topk import radix_plan, radix_topk

HEADS, L, R, PAGE = 16, 512, 64, 16
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
SCALE = 192 ** -0.5
GRAPH_WIDTH = 131072  # a decode graph's score rows are max_model_len wide
SHAPES = [(1, 8192), (64, 8192), (1, 32768), (64, 32768)]  # (batch, context)
DEVICE = "cuda"


def case(batch: int, ctx: int):
    dev, bf = DEVICE, torch.bfloat16
    nblk = -(-ctx // PAGE)
    bt = torch.randperm(batch * nblk, device=dev).view(batch, nblk).int()
    return dict(
        latent=torch.randn(batch * nblk, PAGE, L + R, device=dev, dtype=bf),
        keys=torch.randn(batch * nblk, PAGE, INDEX_DIM, device=dev, dtype=bf),
        bt=bt, sl=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        req=torch.arange(batch, dtype=torch.int32, device=dev),
        pos=torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev),
        q_lat=torch.randn(batch, HEADS, L, device=dev, dtype=bf), q_pe=torch.randn(batch, HEADS, R, device=dev, dtype=bf),
        iq=torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=dev, dtype=bf),
        iw=torch.randn(batch, INDEX_HEADS, device=dev) * (INDEX_HEADS * INDEX_DIM) ** -0.5)


def index_inputs(c: dict, key_dtype: str):
    """(index query, head weights, key cache) of the case in the indexer key format: the bf16 keys as they are, or
    quantized (the bf16 keys of the case are the keys before rotation)."""
    if key_dtype == "bf16":
        return c["iq"], c["iw"], c["keys"]
    k8, ks = quantize_index_keys(c["keys"].view(-1, INDEX_DIM))
    q8, w8 = quantize_index_queries(c["iq"], c["iw"])
    return q8, w8, (k8.view(c["keys"].shape), ks.view(*c["keys"].shape[:2], 1))


def timed(fn, iters: int) -> float:
    try:
        return time_us(fn, iters)
    except Exception:  # not capturable: eager timing
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e6


def check_errors(key_dtype: str) -> None:
    """The kernels against the float32 reference on one small case (8 decodes x 3000); with fp8 keys the reference
    reads the same fp8 values, and the recall against the unquantized keys' top-k is printed beside it."""
    c = case(8, 3000)
    iq, iw, keys_cache = index_inputs(c, key_dtype)
    got = select_topk(iq, iw, keys_cache, c["bt"], c["req"], c["pos"], 3000, TOPK)
    ref_cache = c["keys"].float() if key_dtype == "bf16" else keys_cache  # the reference dequantizes fp8
    want = select_topk_ref(iq.float(), iw, ref_cache, c["bt"], list(range(9)), [3000] * 8, TOPK)
    recall = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got.cpu(), want.cpu())) / want.numel()
    radix = select_topk(iq, iw, keys_cache, c["bt"], c["req"], c["pos"], 3000, TOPK, topk_impl="radix")
    same = sum(len(set(g.tolist()) & set(r.tolist())) for g, r in zip(got.cpu(), radix.cpu())) / got.numel()
    print(f"{key_dtype} keys: radix top-k vs torch.topk on the same scores: {same:.4f} of the selection in common")
    graph = select_topk(iq, iw, keys_cache, c["bt"], c["req"], c["pos"], GRAPH_WIDTH, TOPK, static_width=True)
    same = sum(len(set(g.tolist()) & set(r.tolist())) for g, r in zip(got.cpu(), graph.cpu())) / got.numel()
    print(f"{key_dtype} keys: the CUDA-graph path's selection vs the eager one: {same:.4f} in common")
    scores_wide = indexer_scores(iq, iw, keys_cache, c["bt"], c["req"], c["pos"], 3000)
    one = radix_topk(scores_wide, TOPK, programs_per_row=1)
    split = radix_topk(scores_wide, TOPK, programs_per_row=16)
    print(f"{key_dtype} keys: radix top-k split over 16 programs a row vs one program: "
          f"{'identical' if torch.equal(one, split) else 'MISMATCH'}")
    for width, kw in ((3000, {"topk_impl": "radix"}), (GRAPH_WIDTH, {"static_width": True})):
        sel = [select_topk(iq, iw, keys_cache, c["bt"], c["req"], c["pos"], width, TOPK, first_pass_in_scores=f,
                           **kw) for f in (False, True)]
        print(f"{key_dtype} keys: first radix pass in the scores kernel vs not, {kw}: "
              f"{'identical' if torch.equal(*sel) else 'MISMATCH'}")
    scores = indexer_scores(iq, iw, keys_cache, c["bt"], c["req"], c["pos"], 3000)
    ref_rows = []
    for b in range(8):
        blocks = c["bt"][b].long()
        if key_dtype == "bf16":
            keys = c["keys"][blocks].flatten(0, 1)[:3000].float()
        else:
            keys = dequantize_index_keys(keys_cache[0][blocks].flatten(0, 1), keys_cache[1][blocks].flatten(0, 1))
            keys = keys[:3000]
        ref_rows.append((iw[b, :, None] * (iq[b].float() @ keys.T).relu()).sum(0))
    ref = torch.stack(ref_rows)
    if key_dtype == "fp8":
        exact = select_topk_ref(c["iq"].float(), c["iw"], c["keys"].float(), c["bt"], list(range(9)), [3000] * 8,
                                TOPK)
        vs_bf16 = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got.cpu(), exact.cpu())) / exact.numel()
        print(f"fp8 keys: top-{TOPK} recall against the unquantized keys {vs_bf16:.4f}")
        mma = indexer_scores(iq, iw, keys_cache, c["bt"], c["req"], c["pos"], 3000, _fp8_dot=True)
        mma_sel, f16_sel = (torch.stack([torch.topk(r, TOPK).indices for r in x]) for x in (mma, scores))
        common = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(mma_sel.cpu(), f16_sel.cpu()))
        print(f"fp8 keys: scores by the FP8 MMA (_fp8_dot) rel err {((mma - ref).norm() / ref.norm()).item():.2e}; "
              f"top-{TOPK} in common with the float16 dot's {common / f16_sel.numel():.4f}")
    out = sparse_mla_attention(c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["req"], got, SCALE)
    ref_out = sparse_mla_attention_ref(c["q_lat"].float(), c["q_pe"].float(), c["latent"].float(), c["bt"],
                                       request_of_tokens(list(range(9)), c["bt"].device), got.long(), SCALE)
    print(f"{key_dtype} keys: indexer scores rel err {((scores - ref).norm() / ref.norm()).item():.2e}; top-{TOPK} "
          f"recall {recall:.4f}; sparse attention rel err "
          f"{((out.float() - ref_out).norm() / ref_out.norm()).item():.2e}")


KEY_BYTES = {"bf16": 2 * INDEX_DIM, "fp8": INDEX_DIM + 4}  # a token's indexer key in the page


def old_sparse(batch: int) -> dict:
    """The sparse attention's first guess: 64-token tiles (on 4 warps above 16 tokens: they spill), splits of at
    least 256 selected tokens."""
    return {"BLOCK_N": 64, "MIN_SPLIT": 256, "num_warps": 8 if batch <= 16 else 4, "num_stages": 2}


def kernels(iters: int, key_dtypes: list[str]) -> None:
    print(f"{'keys':>5} {'batch':>5} {'ctx':>6} {'dense us':>9} {'scores':>8} {'top-k':>8} {'radix 1p':>9} "
          f"{'radix':>8} {'P':>8} {'sp old':>8} {'sparse':>8} {'splits':>7} {'DSA us':>9} {'speedup':>8} "
          f"{'w/ radix':>9} {'graph':>8} {'byte ceiling':>12}")
    for batch, ctx in SHAPES:
        c = case(batch, ctx)
        sms = _sms_for(c["q_lat"])
        dense = timed(lambda: mla_decode_attention(c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["sl"], SCALE,
                                                   max_seq_len=ctx), iters)
        programs, block = radix_plan(batch, ctx, sms)
        plan = "1p" if programs == 1 else f"{programs}x{block}"
        old_splits, new_splits = (sparse_num_splits(batch, HEADS, TOPK, sms, cfg)
                                  for cfg in (old_sparse(batch), None))
        splits = f"{old_splits}/{new_splits}"
        for key_dtype in key_dtypes:
            iq, iw, keys = index_inputs(c, key_dtype)
            scores = timed(lambda: indexer_scores(iq, iw, keys, c["bt"], c["req"], c["pos"], ctx), iters)
            s = indexer_scores(iq, iw, keys, c["bt"], c["req"], c["pos"], ctx)
            topk = timed(lambda: s.topk(TOPK, dim=-1), iters)
            radix_one = timed(lambda: radix_topk(s, TOPK, programs_per_row=1), iters)
            radix = timed(lambda: radix_topk(s, TOPK), iters)
            if not torch.equal(radix_topk(s, TOPK), radix_topk(s, TOPK, programs_per_row=1)):
                print(f"MISMATCH: radix top-k planned {plan} differs from one program a row ({batch} x {ctx})")
            idx = select_topk(iq, iw, keys, c["bt"], c["req"], c["pos"], ctx, TOPK)
            sparse_old = timed(lambda: sparse_mla_attention(c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["req"],
                                                            idx, SCALE, _config=old_sparse(batch)), iters)
            sparse = timed(lambda: sparse_mla_attention(c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["req"], idx,
                                                        SCALE), iters)
            whole = timed(lambda: sparse_mla_attention(
                c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["req"],
                select_topk(iq, iw, keys, c["bt"], c["req"], c["pos"], ctx, TOPK), SCALE), iters)
            whole_radix = timed(lambda: sparse_mla_attention(
                c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["req"],
                select_topk(iq, iw, keys, c["bt"], c["req"], c["pos"], ctx, TOPK, topk_impl="radix"), SCALE), iters)
            whole_graph = timed(lambda: sparse_mla_attention(
                c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["req"],
                select_topk(iq, iw, keys, c["bt"], c["req"], c["pos"], GRAPH_WIDTH, TOPK, static_width=True),
                SCALE), iters)
            latent_bytes = 2 * (L + R)
            ceiling = ctx * latent_bytes / (ctx * KEY_BYTES[key_dtype] + TOPK * latent_bytes)
            print(f"{key_dtype:>5} {batch:>5} {ctx:>6} {dense:>9.1f} {scores:>8.1f} {topk:>8.1f} {radix_one:>9.1f} "
                  f"{radix:>8.1f} {plan:>8} {sparse_old:>8.1f} {sparse:>8.1f} {splits:>7} {whole:>9.1f} "
                  f"{dense / whole:>7.2f}x {dense / whole_radix:>8.2f}x {dense / whole_graph:>7.2f}x "
                  f"{ceiling:>11.2f}x")
            del iq, iw, keys, s, idx
        del c
        torch.cuda.empty_cache()


def sweep(iters: int) -> None:
    """The sparse attention at every split count (three tiles), the indexer scores by grid and dot, and the
    radix top-k at every programs-per-row count (BLOCK 256, 512, 1024), on the bf16 keys' scores and selection; the
    best of each line marked *."""
    def show(label: str, times: dict) -> None:
        best = min(times, key=times.get)
        print(f"  {label}: " + "  ".join(f"{k}{'*' if k == best else ''} {v:.1f}" for k, v in times.items()))

    for batch, ctx in SHAPES:
        c = case(batch, ctx)
        sms = _sms_for(c["q_lat"])
        idx = select_topk(c["iq"], c["iw"], c["keys"], c["bt"], c["req"], c["pos"], ctx, TOPK)
        print(f"batch {batch} x {ctx}: sparse attention us by splits (chosen "
              f"{sparse_num_splits(batch, HEADS, TOPK, sms)}), radix top-k us by programs a row (plan "
              f"{radix_plan(batch, ctx, sms)})")
        for block_n, warps, stages in ((64, 8, 2), (32, 4, 3), (32, 8, 2)):  # tiles that do not spill
            cfg = {"BLOCK_N": block_n, "MIN_SPLIT": block_n, "num_warps": warps, "num_stages": stages}
            show(f"sparse BLOCK_N {block_n}, {warps} warps, {stages} stages", {
                n: timed(lambda n=n: sparse_mla_attention(c["q_lat"], c["q_pe"], c["latent"], c["bt"], c["req"], idx,
                                                          SCALE, num_splits=n, _config=cfg), iters)
                for n in (1, 2, 4, 8, 16, 32, 64) if n * block_n <= TOPK})
        for key_dtype in ("bf16", "fp8"):
            iq, iw, keys = index_inputs(c, key_dtype)
            out = torch.empty(batch, ctx, device=DEVICE)
            variants = {"eager": {}, "strided": {"visible_only": True}}
            if key_dtype == "fp8":
                variants |= {"eager fp8-mma": {"_fp8_dot": True}, "strided fp8-mma": {"visible_only": True,
                                                                                       "_fp8_dot": True}}
            show(f"scores {key_dtype} keys", {
                name: timed(lambda kw=kw: indexer_scores(iq, iw, keys, c["bt"], c["req"], c["pos"], ctx, out=out,
                                                         **kw), iters)
                for name, kw in variants.items()})
            del iq, iw, keys, out
        s = indexer_scores(c["iq"], c["iw"], c["keys"], c["bt"], c["req"], c["pos"], ctx)
        for block in (256, 512, 1024):
            show(f"radix BLOCK {block}", {
                p: timed(lambda p=p: radix_topk(s, TOPK, block=block, programs_per_row=p), iters)
                for p in (1, 2, 4, 8, 16, 32, 64, 128, 256) if p == 1 or p * block <= ctx})
        show("select_topk (scores + radix top-k), first pass in the scores kernel or not", {
            f"{name}{' first-in-scores' if first else ''}": timed(
                lambda width=width, kw=kw, first=first: select_topk(
                    c["iq"], c["iw"], c["keys"], c["bt"], c["req"], c["pos"], width, TOPK,
                    first_pass_in_scores=first, **kw), iters)
            for name, width, kw in (("eager", ctx, {"topk_impl": "radix"}),
                                    ("graph", GRAPH_WIDTH, {"static_width": True}))
            for first in (False, True)})
        del c, s, idx
        torch.cuda.empty_cache()


def e2e(key_dtypes: list[str], prompt_len: int = 32768, n: int = 8, decode_steps: int = 64) -> None:
    """Decode throughput at 32k contexts: n requests of prompt_len random tokens are prefilled, then decode steps
    are timed on their own (benchmarks/engine_steps.py). The DSA shape once per indexer key format, then its dense
    twin. (Until 2026-12-06 this took the difference of a prefill-only run and a full run on fresh prompts: a
    prefill's run-to-run spread at 8 x 32k exceeded the decode time, and the H100 showed DSA at 0.45x dense where
    the steps themselves ran at 1.04x.)"""
    import random

    from benchmarks.common import write_shape
    from benchmarks.engine_steps import decode_ms_per_step, prefill_all
    from kestrel import LLM, SamplingParams

    rng = random.Random(0)
    runs = [("deepseek-v2-lite-dsa", k) for k in key_dtypes] + [("deepseek-v2-lite-dsa-dense", "bf16")]
    for shape, key_dtype in runs:
        llm = LLM(str(write_shape(shape)), load_format="dummy", dtype="bfloat16", progress=False,
                  max_model_len=prompt_len + decode_steps + 16, indexer_key_dtype=key_dtype)
        llm.generate([[rng.randint(0, 9999) for _ in range(64)]], SamplingParams(max_tokens=4, ignore_eos=True))
        eng = llm.engine
        for _ in range(n):
            eng.add_request([rng.randint(0, 9999) for _ in range(prompt_len)],
                            SamplingParams(temperature=0, max_tokens=decode_steps + 8, ignore_eos=True))
        prefill_s, prefill_steps = prefill_all(eng)
        ms = decode_ms_per_step(eng, decode_steps)
        runner = eng.core.executor.runner
        replays = runner.graphs.replays if runner.graphs is not None else 0
        print(f"{shape} ({runner.backend.name}, {key_dtype} indexer keys): {n} x {prompt_len}: prefill "
              f"{prefill_s:.2f} s in {prefill_steps} steps; decode {ms:.2f} ms a step, {n * 1e3 / ms:.1f} out tok/s "
              f"({replays} decode-graph replays)")
        del runner, eng
        llm.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--e2e-n", type=int, default=8, help="requests of 32k tokens in the whole-engine run")
    ap.add_argument("--indexer-key-dtype", choices=["bf16", "fp8", "both"], default="both")
    ap.add_argument("--sweep", action="store_true", help="also every split count / programs a row (see above)")
    args = ap.parse_args()
    key_dtypes = ["bf16", "fp8"] if args.indexer_key_dtype == "both" else [args.indexer_key_dtype]
    for key_dtype in key_dtypes:
        check_errors(key_dtype)
    kernels(args.iters, key_dtypes)
    if args.sweep:
        sweep(args.iters)
    if args.e2e:
        e2e(key_dtypes, n=args.e2e_n)


if __name__ == "__main__":
    main()

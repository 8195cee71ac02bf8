"""Host cost of structured outputs per decode step, without a model: 256 requests under benchmarks/structured.py's
JSON schema advance through JSON text (each step a random token that the grammar allows, as a random-weight
model samples), through the engine's own StructuredOutputManager: accept_tokens (the engine loop) and
start_fill -> result (the fill pool), for several fill-thread counts.

Per step it reports the accept time, the fill time alone, and the fill time while the engine loop does
--host-work-ms of pure-Python work after start_fill (what the loop does meanwhile: outputs, scheduling, the next
step's inputs): with the fill off the loop's back, that is max(fill, host work), not their sum. It also reports the
single-thread CPU cost per row, which says what the fill needs on any machine: rows x cost / threads.

    python benchmarks/structured_fill.py [--threads 1,4,8,14] [--rows 256] [--steps 40] [--host-work-ms 2]"""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from common import print_table
from structured import SCHEMA, train_tokenizer

from kestrel.engine.sampling_params import StructuredOutputsParams
from kestrel.structured_output.manager import StructuredOutputManager, default_fill_threads


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    n = 0
    while time.perf_counter() < end:
        n += 1


def run(tok, threads: int, rows: int, steps: int, host_ms: float, seed: int) -> dict:
    mgr = StructuredOutputManager(tok, len(tok), tok.eos_token_id, max_rows=rows, fill_threads=threads)
    compiled = mgr.submit(StructuredOutputsParams(json=SCHEMA)).result()
    rng = random.Random(seed)
    grammars = [mgr.new_request_grammar(compiled, tok.eos_token_id) for _ in range(rows)]
    lengths = [0] * rows
    tokens = None
    t_acc, c_acc, t_fill, t_overlap, n = 0.0, 0.0, 0.0, 0.0, 0
    for step in range(steps + 3):  # 3 warm-up steps
        dt_acc = cpu_acc = 0.0
        if tokens is not None:
            t, c = time.perf_counter(), time.thread_time()
            mgr.accept_tokens(list(zip(grammars, tokens)))
            dt_acc, cpu_acc = time.perf_counter() - t, time.thread_time() - c
        for i, g in enumerate(grammars):  # a request done (JSON complete, or long): a new one takes its row
            if g.terminated or lengths[i] >= 600:
                grammars[i] = mgr.new_request_grammar(compiled, tok.eos_token_id)
                lengths[i] = 0
        batch = list(enumerate(grammars))
        t = time.perf_counter()
        mask, where = mgr.start_fill(batch).result()
        dt_fill = time.perf_counter() - t
        # the same fill again (the grammars have not moved) while the engine loop works in Python meanwhile
        t = time.perf_counter()
        job = mgr.start_fill(batch)
        busy(host_ms)
        mask, where = job.result()
        dt_overlap = time.perf_counter() - t
        if step >= 3:
            t_acc, c_acc, n = t_acc + dt_acc, c_acc + cpu_acc, n + 1
            t_fill, t_overlap = t_fill + dt_fill, t_overlap + dt_overlap
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :len(tok)]
        tokens = [0] * rows
        for j, row in enumerate(where):
            allowed = np.flatnonzero(bits[j])
            tokens[row] = int(allowed[rng.randrange(len(allowed))])
        lengths = [x + 1 for x in lengths]
    mgr.shutdown()
    return dict(threads=threads, accept_ms=t_acc / n * 1e3, accept_cpu_ms=c_acc / n * 1e3, fill_ms=t_fill / n * 1e3,
                fill_with_host_work_ms=t_overlap / n * 1e3, hidden_ms=(t_fill + host_ms / 1e3 * n - t_overlap) / n * 1e3)


def cpu_per_row(tok, rows: int, steps: int, seed: int) -> float:
    """Single-thread CPU microseconds per row fill (thread time of the fill itself)."""
    import xgrammar as xgr

    mgr = StructuredOutputManager(tok, len(tok), tok.eos_token_id, max_rows=rows, fill_threads=1)
    compiled = mgr.submit(StructuredOutputsParams(json=SCHEMA)).result()
    rng = random.Random(seed)
    grammars = [mgr.new_request_grammar(compiled, tok.eos_token_id) for _ in range(rows)]
    import torch

    buf = torch.empty((rows, mgr.width), dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher(1)
    total, count = 0.0, 0
    for _ in range(steps):
        live = [g for g in grammars if not g.terminated]
        t = time.thread_time()
        batch.batch_fill_next_token_bitmask([g.matcher for g in live], buf, list(range(len(live))))
        total += time.thread_time() - t
        count += len(live)
        bits = np.unpackbits(buf[:len(live)].numpy().view(np.uint8), axis=1, bitorder="little")[:, :len(tok)]
        for j, g in enumerate(live):
            allowed = np.flatnonzero(bits[j])
            g.accept(int(allowed[rng.randrange(len(allowed))]))
    mgr.shutdown()
    return total / count * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=None, help=f"comma-separated fill-thread counts (default: 1, and the "
                    f"engine's default here, {default_fill_threads()})")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--host-work-ms", type=float, default=2.0)
    ap.add_argument("--tokenizer-vocab", type=int, default=100000)
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer folder instead of training one")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tok = train_tokenizer(args.tokenizer_vocab)
    threads = sorted({int(x) for x in args.threads.split(",")} if args.threads else {1, default_fill_threads()})
    per_row = cpu_per_row(tok, args.rows, min(args.steps, 20), 0)
    results = [run(tok, t, args.rows, args.steps, args.host_work_ms, 0) for t in threads]
    print_table(f"Structured-output host work per step: {args.rows} rows, JSON schema, tokenizer {len(tok)} tokens, "
                f"host work {args.host_work_ms} ms", results)
    print(f"\nfill, one thread: {per_row:.1f} us CPU per row ({per_row * args.rows / 1e3:.2f} ms per step of "
          f"{args.rows} rows)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=args.rows, tokenizer=len(tok), cpu_us_per_row=per_row, runs=results), f, indent=1)


if __name__ == "__main__":
    main()

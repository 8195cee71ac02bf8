"""Host cost of structured outputs per decode step, without a model: 256 requests under benchmarks/structured.py's
JSON schema advance through JSON text (each step a random token that the grammar allows, as a random-weight
model samples), through the engine's own StructuredOutputManager.start_step (the grammars take their tokens in
one batch call, then the pool fills the bitmask), for several fill-thread counts.

Per step it reports how long the engine loop waits in start_step (until the tokens are in), the whole step
(tokens + fill) when the loop just waits for it, and the same while the loop does --host-work-ms of pure-Python
work after start_step (what it does meanwhile: outputs, scheduling, the next step's inputs): with the fill off the
loop's back, that is max(fill, host work), not their sum. It also reports the single-thread CPU cost per row fill,
which says what the fill needs on any machine: rows x cost / threads.
(xgrammar's own C++ pool, one call over every row, was tried in session 7 and lost in the engine: 60.8% against
75-88% of unconstrained throughput; docs/benchmarks.md.)

    python -m benchmarks.structured_fill [--threads 1,4,8,14] [--rows 256] [--steps 40] [--host-work-ms 2]

On the 2-core development machine (shared; wall times there are noisy) the fill costs ~36 us of CPU a row."""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from benchmarks.common import print_table
from benchmarks.structured import SCHEMA, train_tokenizer
from kestrel.core.sampling_params import StructuredOutputsParams
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
    tokens = [None] * rows
    t_adv, t_step, t_overlap, n = 0.0, 0.0, 0.0, 0
    for step in range(steps + 3):  # 3 warm-up steps
        accepts = [(g, t) for g, t in zip(grammars, tokens) if t is not None]
        replaced = [i for i, (g, t) in enumerate(zip(grammars, tokens))
                    if lengths[i] >= 600 or (t is not None and t in g.stop_ids)]
        for i in replaced:  # a request done (JSON complete, or long): a new one takes its row after this step
            lengths[i] = 0
        batch = [(i, g) for i, g in enumerate(grammars) if i not in replaced]
        # the step as the engine runs it: tokens into the grammars, then the fill, the loop waiting for it
        t = time.perf_counter()
        job = mgr.start_step(accepts, batch)
        dt_adv = time.perf_counter() - t
        job.result()
        dt_step = time.perf_counter() - t
        for i in replaced:
            grammars[i] = mgr.new_request_grammar(compiled, tok.eos_token_id)
        batch = list(enumerate(grammars))
        # the fill again (every row) while the engine loop works in Python meanwhile
        t = time.perf_counter()
        job = mgr.start_step([], batch)
        busy(host_ms)
        mask, where = job.result()
        dt_overlap = time.perf_counter() - t
        if step >= 3:
            t_adv, t_step, t_overlap, n = t_adv + dt_adv, t_step + dt_step, t_overlap + dt_overlap, n + 1
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :len(tok)]
        tokens = [None] * rows
        for j, row in enumerate(where):
            allowed = np.flatnonzero(bits[j])
            tokens[row] = int(allowed[rng.randrange(len(allowed))])
        lengths = [x + 1 for x in lengths]
    mgr.shutdown()
    return dict(threads=threads, start_step_ms=t_adv / n * 1e3, step_ms=t_step / n * 1e3,
                fill_with_host_work_ms=t_overlap / n * 1e3)


def cpu_per_row(tok, rows: int, steps: int, seed: int) -> tuple[float, float]:
    """Single-thread CPU microseconds per row: the fill, and the accept of a token (thread time of each call)."""
    import torch
    import xgrammar as xgr

    mgr = StructuredOutputManager(tok, len(tok), tok.eos_token_id, max_rows=rows, fill_threads=1)
    compiled = mgr.submit(StructuredOutputsParams(json=SCHEMA)).result()
    rng = random.Random(seed)
    grammars = [mgr.new_request_grammar(compiled, tok.eos_token_id) for _ in range(rows)]
    buf = torch.empty((rows, mgr.width), dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher(1)
    fill = accept = 0.0
    count = 0
    for _ in range(steps):
        live = [g for g in grammars if not g.terminated]
        t = time.thread_time()
        batch.batch_fill_next_token_bitmask([g.matcher for g in live], buf, list(range(len(live))))
        fill += time.thread_time() - t
        count += len(live)
        bits = np.unpackbits(buf[:len(live)].numpy().view(np.uint8), axis=1, bitorder="little")[:, :len(tok)]
        toks = []
        for j in range(len(live)):
            allowed = np.flatnonzero(bits[j])
            toks.append(int(allowed[rng.randrange(len(allowed))]))
        t = time.thread_time()
        xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in live], toks)
        accept += time.thread_time() - t
        for g, t in zip(live, toks):
            g.accepted(t, True)
    mgr.shutdown()
    return fill / count * 1e6, accept / count * 1e6


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
    per_row, per_accept = cpu_per_row(tok, args.rows, min(args.steps, 20), 0)
    results = [run(tok, t, args.rows, args.steps, args.host_work_ms, 0) for t in threads]
    print_table(f"Structured-output host work per step: {args.rows} rows, JSON schema, tokenizer {len(tok)} tokens, "
                f"host work {args.host_work_ms} ms", results)
    print(f"\none thread, CPU per row: fill {per_row:.1f} us, accept {per_accept:.1f} us "
          f"({(per_row + per_accept) * args.rows / 1e3:.2f} ms per step of {args.rows} rows)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=args.rows, tokenizer=len(tok), cpu_us_per_row_fill=per_row,
                           cpu_us_per_row_accept=per_accept, runs=results), f, indent=1)


if __name__ == "__main__":
    main()

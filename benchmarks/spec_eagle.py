"""EAGLE-3 drafter cost (--eagle3-cost): what drafting k tokens with an EAGLE-3 head adds to a step, on a
random-weight target shape with a random EAGLE-3 draft written at that shape (kestrel/bench/eagle3_draft.py; for
llama-8b: hidden 4096, MLP 14336, 32/8 heads, draft vocabulary --draft-vocab target ids mapped back by d2t, as
the public EAGLE3-LLaMA3.1-Instruct-8B).

A random draft is never right, so every EAGLE-3 step verifies k drafts and keeps none: its ms/token is one step's
time. The replay proposer at alpha 0 runs the same verify step with a drafter that costs nothing, so

    drafter ms/step = EAGLE-3 ms/token - replay(alpha 0) ms/token    (same k, same batch)

and with a trained draft of the acceptance that replay alpha stands for,

    projected EAGLE-3 ms/token(alpha) = replay ms/token(alpha) + drafter ms/step / mean accepted length(alpha)

(each step drafts once and emits `mean accepted length` tokens). The drafter's work a step hardly depends on how
many drafts were accepted (its first forward covers the 1 + accepted new positions of each request, then k - 1
one-token forwards: kestrel/spec_decode/eagle3_drafter.py), so its cost measured at acceptance 0 is a close lower
bound at any alpha.

    python -m benchmarks.spec_decode --eagle3-cost --shape llama-8b --batches 1,8 --ks 2,4 --alphas 0.8"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks.common import SHAPES
from benchmarks.spec_replay import best_k, engine_kwargs, plain_rows, replay_rows
from benchmarks.spec_timing import row_of, timed_generate, timed_with_acceptance

LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "bos_token_id",
              "eos_token_id")


def write_shape_draft(shape: str, draft_vocab: int) -> Path:
    """A random EAGLE-3 draft (EAGLE authors' layout, bf16) whose layer has the target shape's dimensions."""
    import torch

    from kestrel.bench.eagle3_draft import LLAMA_LAYER, write_eagle3_draft

    layer = dict(LLAMA_LAYER, **{k: SHAPES[shape][k] for k in LAYER_KEYS if k in SHAPES[shape]})
    out = Path(tempfile.mkdtemp(prefix=f"kestrel-eagle3-{shape}-"))
    return write_eagle3_draft(out, layer, min(draft_vocab, layer["vocab_size"]), dtype=torch.bfloat16)


def eagle3_rows(model, common, args, device, prompts, draft: str, batches, ks) -> list[dict]:
    from kestrel import LLM

    rows = []
    for k in ks:
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k, "disable_by_batch_size": None}
        llm = LLM(model, speculative_config=spec, **common)
        for b in batches:
            timed_generate(llm, prompts[:b], args.output_len, device, 1)  # warm-up
            ttft, total, _, mean_len = timed_with_acceptance(llm, prompts[:b], args.output_len, device, args.reps)
            rows.append(row_of("EAGLE-3 random draft", b, k, "", args.output_len, ttft, total, mean_len))
        llm.shutdown()
    return rows


def projections(replay: list[dict], eagle: list[dict]) -> list[dict]:
    """A row per (batch, k, alpha): the drafter's cost per step and the projected EAGLE-3 ms/token."""
    ms = {(r["batch"], r["k"], r["alpha"]): r for r in replay}
    out = []
    for e in eagle:
        b, k = e["batch"], e["k"]
        drafter = e["ms_per_token"] - ms[(b, k, 0.0)]["ms_per_token"]
        for (rb, rk, alpha), r in sorted(ms.items(), key=lambda kv: kv[0][2]):
            if (rb, rk) != (b, k) or alpha == 0.0:
                continue
            mean_len = float(r["mean_accepted_len"] or 1)
            out.append(dict(batch=b, k=k, drafter_ms_per_step=drafter, alpha=alpha,
                            replay_ms_per_token=r["ms_per_token"], mean_accepted_len=r["mean_accepted_len"],
                            projected_eagle3_ms_per_token=r["ms_per_token"] + drafter / mean_len))
    return out


def eagle3_cost(args, device, batches, alphas, ks) -> dict:
    if args.model:
        raise SystemExit("--eagle3-cost writes its draft at a --shape; --model is not supported with it")
    model, common = engine_kwargs(args, device, batches, ks)
    draft = write_shape_draft(args.shape, args.draft_vocab)
    rows, prompts, refs = plain_rows(model, common, args, device, batches)
    replay = replay_rows(model, common, args, device, prompts, refs, batches, sorted({0.0, *alphas}), ks)
    try:
        eagle = eagle3_rows(model, common, args, device, prompts, str(draft), batches, ks)
    finally:
        shutil.rmtree(draft, ignore_errors=True)  # ~0.85 GB for llama-8b
    best = best_k(rows + [r for r in replay if r["alpha"] != 0.0])  # the replay run's own summary (as specd's)
    return dict(rows=rows + replay + eagle, best=best, projections=projections(replay, eagle))

"""The replay-proposer measurement of benchmarks/spec_decode.py: a run without speculation (its own rows), then one
engine per k whose replay proposer proposes each prompt's reference tokens, each kept with probability alpha
(kestrel/spec_decode/replay.py). The references are recorded by that engine's own warm-up at alpha 0, so that the
target keeps to them in bf16 (replay_rows says why)."""
from __future__ import annotations

from benchmarks.common import nano_workload, write_shape
from benchmarks.spec_timing import row_of, timed_generate, timed_with_acceptance


def engine_kwargs(args, device: str, batches: list[int], ks: list[int]) -> tuple[str, dict]:
    """(model folder, LLM keywords) every engine of a run shares: a random-weight shape (or --model), room for
    the largest batch with k + 1 tokens a request."""
    if args.model:
        model, load = args.model, {}
    else:
        model, load = str(write_shape(args.shape)), dict(load_format="dummy", dtype="bfloat16")
    return model, dict(device=device, max_num_seqs=max(batches), enable_prefix_caching=False, progress=False,
                       max_model_len=args.prompt_len + args.output_len + 16,
                       max_num_batched_tokens=max(2048, max(batches) * (1 + max(ks))), **load)


def plain_rows(model, common, args, device, batches) -> tuple[list[dict], list[list[int]], dict]:
    """No speculation: (rows, the prompts, {batch: [[prompt ids, greedy output ids], ...]}: each batch's own
    references for the replay proposer, since in bf16 a batch size's kernels can break a near-tie differently)."""
    from kestrel import LLM

    rows, references = [], {}
    plain = LLM(model, **common)
    vocab = min(10000, int(plain.engine.core.model_config.vocab_size))
    prompts = nano_workload(max(batches), seed=3, in_range=(args.prompt_len, args.prompt_len), vocab_cap=vocab)[0]
    for b in batches:
        timed_generate(plain, prompts[:b], args.output_len, device, 1)  # warm-up
        ttft, total, outs = timed_generate(plain, prompts[:b], args.output_len, device, args.reps)
        references[b] = [[list(p), o] for p, o in zip(prompts[:b], outs)]
        rows.append(row_of("no speculation", b, 0, "", args.output_len, ttft, total))
    plain.shutdown()  # frees the GPU for the next engine (CUDA-graph cycles wait for a full collection)
    return rows, prompts, references


def followed(refs: list, outs: list[list[int]]) -> float:
    """The mean number of leading output tokens equal to the reference: where it is far below the output length,
    the target left its reference early (a bf16 near-tie broken differently by the verify kernels), and every
    draft after that point is wrong whatever alpha is."""
    n = []
    for (_, ref), out in zip(refs, outs):
        n.append(next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out))))
    return sum(n) / max(len(n), 1)


def replay_rows(model, common, args, device, prompts, refs, batches, alphas, ks) -> list[dict]:
    """A row per (k, batch, alpha); an engine per k: its verify CUDA graphs are captured for exactly k drafts a
    request, and the one engine serves every alpha."""
    from kestrel import LLM

    rows = []
    for k in ks:
        spec_cfg = {"method": "replay", "num_speculative_tokens": k, "disable_by_batch_size": None,
                    "replay_references": refs[batches[0]]}
        llm = LLM(model, speculative_config=spec_cfg, **common)
        proposer = llm.engine.core.speculation.proposer
        for b in batches:
            # The warm-up, at alpha 0, records the references the timed runs replay: the target's own greedy
            # tokens under verify steps of this k and batch. Every verify step has b * (k + 1) rows whatever is
            # accepted, so a token's row computes the same numbers at any alpha, and the target keeps to them.
            # (The plain run's tokens do not serve: on the H100, llama-8b's bf16 random weights left them after
            # about 4 tokens, the verify kernels breaking near-ties differently from the decode kernels.)
            proposer.references = {tuple(p): list(o) for p, o in refs[b]}
            proposer.alpha = 0.0
            outs = timed_generate(llm, prompts[:b], args.output_len, device, 1)[2]
            own = [[list(p), o] for p, o in zip(prompts[:b], outs)]
            proposer.references = {tuple(p): list(o) for p, o in own}
            for alpha in alphas:
                proposer.alpha = alpha
                ttft, total, outs, mean_len = timed_with_acceptance(llm, prompts[:b], args.output_len, device,
                                                                    args.reps)
                rows.append(row_of("replay drafts", b, k, alpha, args.output_len, ttft, total, mean_len,
                                   followed=round(followed(own, outs), 1),
                                   plain_followed=round(followed(refs[b], outs), 1)))
        llm.shutdown()
    return rows + default_rows(model, common, args, device, prompts, batches, alphas, max(ks))


def default_rows(model, common, args, device, prompts, batches, alphas, k) -> list[dict]:
    """What a user gets at the batches above the default disable_by_batch_size: the same replay engine with that
    key left out (no drafts while more requests run), for issue 44's 'no slower than without speculation'."""
    from kestrel import LLM
    from kestrel.spec_decode.config import SpeculativeConfig

    limit = SpeculativeConfig.disable_by_batch_size
    over = [b for b in batches if limit is not None and b > limit]
    if not over:
        return []
    llm = LLM(model, speculative_config={"method": "replay", "num_speculative_tokens": k}, **common)
    rows = []
    for b in over:
        timed_generate(llm, prompts[:b], args.output_len, device, 1)  # warm-up
        ttft, total, _, mean_len = timed_with_acceptance(llm, prompts[:b], args.output_len, device, args.reps)
        rows.append(row_of(f"replay, default disable_by_batch_size={limit}", b, k, max(alphas), args.output_len,
                           ttft, total, mean_len))
    llm.shutdown()
    return rows


def best_k(rows) -> list[dict]:
    """Per (batch, alpha): the fastest k, beside the same batch without speculation."""
    base = {r["batch"]: r["ms_per_token"] for r in rows if r["k"] == 0}
    best = {}
    for r in rows:
        key = (r["batch"], r["alpha"])
        if r["k"] and r["config"] == "replay drafts" and (key not in best or r["ms_per_token"] < best[key]["ms_per_token"]):
            best[key] = r
    return [dict(batch=b, alpha=a, best_k=r["k"], ms_per_token=r["ms_per_token"], no_spec_ms_per_token=base[b],
                 speedup=f"{base[b] / r['ms_per_token']:.2f}x") for (b, a), r in sorted(best.items())]

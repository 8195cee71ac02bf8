"""Speculative decoding at controlled acceptance: ms per output token with and without drafts, on random-weight
model shapes (weights cannot be downloaded on the GPU machine, and a real drafter is never right about random
weights).

The drafts come from the *replay* proposer (kestrel/spec_decode/replay.py): a warm-up of the speculating engine at
alpha 0 records each prompt's greedy output, and the replay proposer then proposes those tokens, each kept with
probability alpha and otherwise replaced by a wrong one. So a verify step costs what it costs with a real drafter of
that acceptance (minus the drafter's own time: n-gram's is host-side and small; EAGLE-3/MTP add a draft forward,
which --eagle3-cost measures). The measured mean accepted length is printed beside each row, and `followed`: the
leading tokens equal to the reference (`plain_followed`: to the run without speculation's).

    python -m benchmarks.spec_decode --shape llama-8b
    python -m benchmarks.spec_decode --shape qwen3-0.6b --batches 1,8,64 --alphas 0.6,0.8,0.9 --ks 2,3,4,5
    python -m benchmarks.spec_decode --model /path/to/checkpoint --device cpu --batches 1 --ks 2 --output-len 16
    python -m benchmarks.spec_decode --ngram-smollm2      # real n-gram drafts, copy-heavy prompts, embedded SmolLM2
    python -m benchmarks.spec_decode --ngram-peer --vllm-pythonpath DIR   # the same side by side with vLLM 0.26
    python -m benchmarks.spec_decode --eagle3-cost --shape llama-8b --ks 2,4 --alphas 0.8   # EAGLE-3 drafter cost

ms/token and tok/s: benchmarks/spec_timing.py. Speculation is forced on at every batch size here
(disable_by_batch_size null); the rows show where it stops paying, which is what the engine's default
disable_by_batch_size should be."""
from __future__ import annotations

import argparse
import json

from benchmarks.common import SHAPES, git_commit, print_table


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a random-weight shape (with "
                    "--ngram-peer: instead of SmolLM2's dequantised copy; it needs a tokenizer)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--alphas", default="0.6,0.8,0.9")
    ap.add_argument("--ks", default="2,3,4,5")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--ngram-smollm2", action="store_true", help="n-gram drafts on copy-heavy prompts with the "
                      "embedded SmolLM2 instead of replay drafts on a shape")
    mode.add_argument("--ngram-peer", action="store_true", help="n-gram drafts on copy-heavy token ids, kestrel and "
                      "vLLM on the same checkpoint (benchmarks/spec_ngram.py)")
    mode.add_argument("--eagle3-cost", action="store_true", help="a random EAGLE-3 draft at --shape: the drafter's "
                      "cost per step beside replay drafts (benchmarks/spec_eagle.py)")
    ap.add_argument("--lookup-min", type=int, default=2, help="n-gram prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=5, help="n-gram prompt_lookup_max")
    ap.add_argument("--vllm-pythonpath", default=None, help="--ngram-peer: put first on the vLLM process's PYTHONPATH")
    ap.add_argument("--vllm-timeout", type=float, default=400, help="--ngram-peer: seconds the vLLM half may take "
                    "(it runs first; past them it is stopped, keeping its finished engines, and kestrel's half runs)")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="--eagle3-cost: the draft's vocabulary")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    batches = [int(x) for x in args.batches.split(",")]
    alphas = [float(x) for x in args.alphas.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = f"output {args.output_len}, device {device}, commit {git_commit()}"
    name = args.model or args.shape
    if args.ngram_smollm2:
        from benchmarks.spec_ngram import ngram_smollm2

        result = dict(model="smollm2", rows=ngram_smollm2(args, device))
        print_table(f"n-gram speculation, SmolLM2-135M-Instruct (embedded), copy-heavy prompts, {where}",
                    result["rows"], digits=3)
    elif args.ngram_peer:
        from benchmarks.spec_ngram import ngram_peer

        result = ngram_peer(args, device)
        lookup = f"prompt_lookup {args.lookup_min}..{args.lookup_max}"
        print_table(f"n-gram speculation side by side, {result['model']}, copy-heavy prompts, {lookup}, {where}",
                    result["rows"], digits=3)
        print_table("n-gram speed-up over each engine's own run without drafts", result["summary"], digits=3)
        print(f"greedy outputs without drafts the engines agree on: {result['same_text_no_spec']}")
    elif args.eagle3_cost:
        from benchmarks.spec_eagle import eagle3_cost

        result = eagle3_cost(args, device, batches, alphas, ks)
        print_table(f"EAGLE-3 drafter cost, {name}, random draft (draft vocab {args.draft_vocab}), prompt "
                    f"{args.prompt_len}, {where}", result["rows"], digits=3)
        print_table("Replay drafts: best k per batch and alpha", result["best"], digits=3)
        print_table("Projected EAGLE-3 ms/token: replay ms/token at alpha + drafter ms/step / mean accepted length",
                    result["projections"], digits=3)
        print("A random draft is (all but) never accepted (the EAGLE-3 rows' mean_accepted_len): those rows measure "
              "a step's cost (draft k, verify k, keep none), not a speed-up.")
    else:
        from benchmarks.spec_replay import best_k, engine_kwargs, plain_rows, replay_rows

        model, common = engine_kwargs(args, device, batches, ks)
        rows, prompts, refs = plain_rows(model, common, args, device, batches)
        rows += replay_rows(model, common, args, device, prompts, refs, batches, alphas, ks)
        rows.sort(key=lambda r: (r["k"] > 0, r["batch"], str(r["alpha"]), r["k"]))
        result = dict(model=name, rows=rows, best=best_k(rows))
        print_table(f"Speculative decoding (replay proposer), {name}, prompt {args.prompt_len}, {where}", rows)
        print_table("Best k per batch and alpha", result["best"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(result, device=device, commit=git_commit()), f, indent=1)
    return result


if __name__ == "__main__":
    main()

"""benchmarks/spec_decode.py runs end to end on the CPU (a tiny model): every configuration gets a row, the replay
proposer at alpha 1 is accepted in full, and the summary picks the fastest k."""
from benchmarks import spec_decode


def test_benchmark_rows_and_acceptance(tiny_llama):
    result = spec_decode.main(["--model", str(tiny_llama), "--device", "cpu", "--batches", "1,3", "--alphas",
                                   "0.5,1.0", "--ks", "2,3", "--output-len", "17", "--prompt-len", "8", "--reps",
                                   "1"])
    rows, best = result["rows"], result["best"]
    assert len(rows) == 2 + 2 * 2 * 2
    full = [r for r in rows if r["alpha"] == 1.0]
    # alpha 1: every draft right; the 16 tokens after the first come k + 1 a step, drafts capped by max_tokens
    for r in full:
        remaining, drafts, accepted = 16, 0, 0
        while remaining:
            cap = min(r["k"], remaining - 1)
            drafts, accepted, remaining = drafts + (cap > 0), accepted + cap, remaining - cap - 1
        assert r["mean_accepted_len"] == f"{1 + accepted / drafts:.2f}"
    half = [float(r["mean_accepted_len"]) for r in rows if r["alpha"] == 0.5]
    assert all(1.0 <= x < 2.5 for x in half)
    assert {(b["batch"], b["alpha"]) for b in best} == {(1, 0.5), (1, 1.0), (3, 0.5), (3, 1.0)}
    for b in best:
        assert b["ms_per_token"] == min(r["ms_per_token"] for r in rows
                                        if r["k"] and (r["batch"], r["alpha"]) == (b["batch"], b["alpha"]))


def test_benchmark_default_config_row_above_disable_by_batch_size(tiny_llama):
    """A batch above the default disable_by_batch_size (32) also gets a row of the engine as a user configures it:
    no drafts there, so nothing is accepted, and the best-k summary ignores that row."""
    result = spec_decode.main(["--model", str(tiny_llama), "--device", "cpu", "--batches", "1,33", "--alphas",
                                   "1.0", "--ks", "2", "--output-len", "5", "--prompt-len", "8", "--reps", "1"])
    default = [r for r in result["rows"] if r["config"].startswith("replay, default")]
    assert [(r["batch"], r["k"]) for r in default] == [(33, 2)]
    assert default[0]["mean_accepted_len"] in ("", "1.00")
    replay33 = [r for r in result["rows"] if r["config"] == "replay drafts" and r["batch"] == 33]
    assert float(replay33[0]["mean_accepted_len"]) > 2.0
    assert [b["ms_per_token"] for b in result["best"] if b["batch"] == 33] == [replay33[0]["ms_per_token"]]

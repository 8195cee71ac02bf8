"""benchmarks/spec_decode.py --ngram-peer and --eagle3-cost on the CPU (tiny models): kestrel's half of the n-gram
side by side gives the same greedy tokens with and without drafts and fills every table field; the vLLM half is
skipped with a line saying why; the EAGLE-3 cost rows and projections add up."""
import importlib.util
import time

import pytest

from benchmarks import common, spec_decode, spec_ngram
from benchmarks.spec_ngram import run_vllm_half

TINY_SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, num_hidden_layers=7,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=384,
                  tie_word_embeddings=False, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  rope_scaling=common.SHAPES["llama-8b"]["rope_scaling"], bos_token_id=1, eos_token_id=2)


def test_ngram_peer_kestrel_half(tiny_llama, capsys):
    result = spec_decode.main(["--ngram-peer", "--model", str(tiny_llama), "--device", "cpu", "--batches", "1,3",
                               "--ks", "2,3", "--output-len", "24", "--reps", "1"])
    out = capsys.readouterr().out
    assert "vLLM half skipped: vLLM runs on the GPU only" in out
    assert result["skipped"] == ["vLLM runs on the GPU only"] and result["same_text_no_spec"] == "n/a"
    outputs = result["outputs"]["kestrel"]
    assert sorted(outputs) == [0, 2, 3] and all(sorted(by_batch) == [1, 3] for by_batch in outputs.values())
    for k in (2, 3):
        for b in (1, 3):
            assert outputs[k][b] == outputs[0][b]  # greedy: drafts change nothing
            assert all(len(o) == 24 for o in outputs[k][b])
    rows = result["rows"]
    assert [(r["k"], r["batch"]) for r in rows] == [(0, 1), (0, 3), (2, 1), (2, 3), (3, 1), (3, 3)]
    for r in rows:
        assert set(r) == {"engine", "config", "batch", "k", "ms_per_token", "tok_per_s", "mean_accepted_len",
                          "speedup", "same_as_no_spec"}
        assert r["engine"] == "kestrel" and r["ms_per_token"] > 0
        assert r["same_as_no_spec"] == f"{r['batch']}/{r['batch']}"
        # the tiny random model repeats itself, so prompt lookup finds drafts and some are right
        assert (r["mean_accepted_len"] == "") == (r["k"] == 0)
        assert r["k"] == 0 or 1.0 < float(r["mean_accepted_len"]) <= r["k"] + 1
    base = {r["batch"]: r["ms_per_token"] for r in rows if r["k"] == 0}
    assert [(s["batch"], s["k"]) for s in result["summary"]] == [(1, 2), (1, 3), (3, 2), (3, 3)]
    for s in result["summary"]:
        row = next(r for r in rows if (r["batch"], r["k"]) == (s["batch"], s["k"]))
        assert s["kestrel_speedup"] == f"{base[s['batch']] / row['ms_per_token']:.2f}x"
        assert s["kestrel_mean_len"] == row["mean_accepted_len"]
        assert s["vllm_ms"] == s["vllm_speedup"] == s["vllm_mean_len"] == ""
    assert "| batch | k | kestrel_ms | kestrel_speedup |" in out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the run without vllm installed")
def test_vllm_half_says_why_it_is_skipped():
    got = run_vllm_half(dict(model="unused", prompts=[[1, 2]], batches=[1], ks=[2]), vllm_pythonpath=None)
    assert got["engine"] == "vllm"
    assert got["skipped"].startswith("vllm is not importable (No module named 'vllm')")


def test_eagle3_cost_rows_and_projection(monkeypatch):
    monkeypatch.setitem(common.SHAPES, "tiny-llama", TINY_SHAPE)
    result = spec_decode.main(["--eagle3-cost", "--shape", "tiny-llama", "--device", "cpu", "--batches", "1,2",
                               "--ks", "2", "--alphas", "1.0", "--output-len", "12", "--prompt-len", "8", "--reps",
                               "1", "--draft-vocab", "100"])
    rows = result["rows"]
    assert [(r["config"], r["batch"], r["alpha"]) for r in rows] == [
        ("no speculation", 1, ""), ("no speculation", 2, ""), ("replay drafts", 1, 0.0), ("replay drafts", 1, 1.0),
        ("replay drafts", 2, 0.0), ("replay drafts", 2, 1.0), ("EAGLE-3 random draft", 1, ""),
        ("EAGLE-3 random draft", 2, "")]
    by = {(r["config"], r["batch"], r["alpha"]): r for r in rows}
    for b in (1, 2):
        assert by[("replay drafts", b, 0.0)]["mean_accepted_len"] == "1.00"  # alpha 0: nothing accepted
        assert float(by[("replay drafts", b, 1.0)]["mean_accepted_len"]) > 2.5  # alpha 1: (almost) all of k = 2
        assert float(by[("EAGLE-3 random draft", b, "")]["mean_accepted_len"]) < 1.5
    assert [(b["batch"], b["alpha"], b["best_k"]) for b in result["best"]] == [(1, 1.0, 2), (2, 1.0, 2)]
    assert len(result["projections"]) == 2
    for p in result["projections"]:
        b, replay = p["batch"], by[("replay drafts", p["batch"], 1.0)]
        drafter = by[("EAGLE-3 random draft", b, "")]["ms_per_token"] - by[("replay drafts", b, 0.0)]["ms_per_token"]
        assert (p["k"], p["alpha"]) == (2, 1.0) and p["drafter_ms_per_step"] == pytest.approx(drafter)
        assert p["projected_eagle3_ms_per_token"] == pytest.approx(
            replay["ms_per_token"] + drafter / float(replay["mean_accepted_len"]))


# A stand-in `vllm` package for the vLLM half's process: vLLM's offline LLM surface (the constructor keywords the
# half passes, generate, get_metrics with the vllm:spec_decode_* counters, llm_engine.engine_core.shutdown) over
# kestrel's engine on the CPU. It checks the half's protocol (job file in, results out, process group, time limit),
# not vLLM. FAKE_VLLM_HANG=1: it hangs in the constructor.
FAKE_VLLM = '''
import os, time
from types import SimpleNamespace
import kestrel
from kestrel import SamplingParams

__version__ = "0.0-fake"


class LLM:
    def __init__(self, model, skip_tokenizer_init, dtype, max_model_len, max_num_seqs, gpu_memory_utilization,
                 enable_prefix_caching, seed, disable_log_stats, speculative_config):
        assert skip_tokenizer_init and not disable_log_stats and not enable_prefix_caching
        if os.environ.get("FAKE_VLLM_HANG"):
            time.sleep(600)
        spec = dict(speculative_config, disable_by_batch_size=None) if speculative_config else None
        self._llm = kestrel.LLM(model, device="cpu", dtype=dtype, max_model_len=max_model_len, seed=seed,
                                max_num_seqs=max_num_seqs, enable_prefix_caching=False, progress=False,
                                speculative_config=spec)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._llm.engine.core.shutdown))

    def generate(self, prompts, params, use_tqdm):
        assert params.detokenize is False
        return self._llm.generate(prompts, params, use_tqdm=use_tqdm)

    def get_metrics(self):
        sp = self._llm.engine.core.speculation
        drafts, accepted = (sp.num_drafts, sp.num_accepted_tokens) if sp else (0, 0)
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[accepted])]
'''


@pytest.fixture
def fake_vllm(tmp_path):
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return str(tmp_path / "fake")


def peer_job(model):
    args = spec_decode.parse(["--model", str(model), "--batches", "1,2", "--ks", "2", "--output-len", "16",
                              "--reps", "1"])
    return spec_ngram.peer_job(args, "cpu")


def test_vllm_half_protocol_and_side_by_side(tiny_llama, fake_vllm, capsys):
    job = peer_job(tiny_llama)
    peer = run_vllm_half(job, fake_vllm, timeout=300)
    assert peer["engine"] == "vllm 0.0-fake" and [run["k"] for run in peer["runs"]] == [0, 2]
    result = spec_ngram.report(job, [spec_ngram.kestrel_half(job, "cpu"), peer])
    assert result["skipped"] == [] and "vLLM half" not in capsys.readouterr().out
    # the same engine underneath: the same tokens, and the same drafts accepted
    assert result["outputs"]["vllm 0.0-fake"] == result["outputs"]["kestrel"]
    assert result["same_text_no_spec"] == "3/3"  # batches 1 and 2
    assert [(r["engine"].split()[0], r["k"], r["batch"]) for r in result["rows"]] == [
        (e, k, b) for e in ("kestrel", "vllm") for k in (0, 2) for b in (1, 2)]
    for s in result["summary"]:
        assert s["vllm_mean_len"] == s["kestrel_mean_len"] and float(s["vllm_mean_len"]) > 1
        assert s["vllm_speedup"].endswith("x") and s["vllm_ms"] > 0


def test_vllm_half_is_stopped_at_its_time_limit(tiny_llama, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_HANG", "1")
    t = time.monotonic()
    got = run_vllm_half(peer_job(tiny_llama), fake_vllm, timeout=8)
    assert time.monotonic() - t < 60
    assert got == {"engine": "vllm", "skipped": "the vLLM process ran past 8 s before writing its results"}

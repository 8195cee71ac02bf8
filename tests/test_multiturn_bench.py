"""benchmarks/multiturn.py on a tiny config (CPU): every conversation's later turns are sent after all others'
earlier ones; with the host tier the returning turns find their prefixes (cached tokens), without it none, and
both runs produce the same contexts (greedy, the same work)."""
import json

from benchmarks.multiturn import main, turn_queue

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=64,
            vocab_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=2,
            bos_token_id=1, eos_token_id=2, max_position_embeddings=4096, torch_dtype="bfloat16")


def test_turn_order():
    assert turn_queue(3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_host_tier_serves_returning_turns(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "mt.json"
    main(["--shape", str(tmp_path), "--conversations", "6", "--turns", "3", "--first-min", "200", "--first-max", "300",
          "--user-len", "20", "--output-len", "4", "--concurrency", "2", "--max-model-len", "1024", "--vocab", "500",
          "--json", str(out)])
    evict, free, none = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in (evict, free, none)] == ["host tier, save at evict", "host tier, save at free",
                                                          "no tier"]
    for tier in (evict, free):
        assert tier["returning_cached_tokens"] >= 6 * 2 * 192 and tier["final_context_mean"] == none["final_context_mean"]
    assert none["returning_cached_tokens"] == 0

"""Speculative decoding under tensor parallelism (2 CPU worker processes): every rank receives the drafts in the
step's chunks and rank 0 answers with the emitted tokens; greedy output equals one process without drafts."""
from tests.tp import engine, greedy, prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_tp2_with_drafts_matches_tp1_without(tp_checkpoint):
    path = tp_checkpoint("qwen3")
    ref_eng = engine(path, 1)
    ref = greedy(ref_eng, prompts())
    eng = engine(path, 2, speculative_config=NGRAM)
    try:
        assert greedy(eng, prompts()) == ref
        assert eng.core.speculation.num_accepted_tokens > 0
    finally:
        eng.core.shutdown()

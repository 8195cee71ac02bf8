"""Speculative decoding: a proposer drafts up to k tokens per request, one target forward verifies them, and the
sampler keeps exactly the tokens plain decoding would have produced (kestrel/spec_decode/verify.py says why).

- config.py: `speculative_config` ({"method": "ngram" | "mtp" | "eagle3" | "replay", "num_speculative_tokens": k,
  ...}) and the start-up refusals of combinations not supported yet.
- ngram.py: prompt lookup (no weights), vectorised over the batch.
- runner_drafts.py: drafts the model runner made (mtp: kestrel/spec_decode/mtp_drafter.py, eagle3:
  kestrel/spec_decode/eagle3_drafter.py; built by kestrel/spec_decode/drafters.py), for the next step.
- replay.py: a benchmark-only proposer that replays a reference continuation, right with probability alpha.
- verify.py: where a verify step's logits rows lie, and the accept rule.
- speculation.py: the engine add-on (who gets drafts, counters); the scheduler counts these proposed tokens in the
token budget and rolls `num_computed_tokens` back past rejected ones."""

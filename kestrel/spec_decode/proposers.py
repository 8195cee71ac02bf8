"""The proposer of a SpeculativeConfig: propose(request ids, TokenSequences, caps) -> drafts per request, and
retain(live request ids) to drop what ended requests left."""
from __future__ import annotations

from kestrel.spec_decode.config import RUNNER_METHODS
from kestrel.spec_decode.ngram import NgramProposer
from kestrel.spec_decode.runner_drafts import RunnerDrafts
from kestrel.spec_decode.replay import ReplayProposer


def make_proposer(cfg, seed: int = 0):
    if cfg.method in RUNNER_METHODS:
        return RunnerDrafts()
    if cfg.method == "ngram":
        return NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    return ReplayProposer(cfg.num_speculative_tokens, cfg.alpha, cfg.replay_references, seed)

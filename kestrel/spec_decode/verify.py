"""Verification of drafts by sampling, with the noise plain decoding would use.

A request with drafts d_0..d_{k-1} is computed over [its last token, d_0, ..., d_{k-1}] in one forward. At each of
the k + 1 positions the sampler draws the target's token y_j exactly as a plain decode step would at that output
position: the same processing (penalties and min_tokens read the outputs so far, here extended by the drafts
before j), and for a seeded request the same noise (seeded by the output position). y_0 is emitted; while
y_j == d_j the draft is accepted and y_{j+1} is emitted too. So every emitted token is the target's own sample
given the tokens before it: greedy and seeded outputs are token-identical to decoding without drafts, and an
unseeded request keeps the target distribution (for a one-hot draft, P(y_j = d_j) = p(d_j) is the rejection
sampler's acceptance probability, and y_j given a mismatch is the (p - q)+ residual).

A step's logits rows: first one row per sampling request (the position after its last known token, in batch
order, as without speculation), then each drafted request's draft positions in the same order."""
from __future__ import annotations

# the rule's two functions sit with the step deltas, below the runner that applies them
from kestrel.core.step import accept, logits_positions

__all__ = ["accept", "logits_positions"]

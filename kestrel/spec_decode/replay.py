"""A proposer for benchmarks only: it knows each prompt's reference continuation (the target's own output,
recorded by a run without speculation) and proposes its next tokens, each right with probability `alpha` and
otherwise replaced by a wrong token. So the acceptance rate is controlled (a chain is accepted up to its first
wrong token), and the engine's cost per emitted token can be measured against it with random weights, where no
real drafter would ever be accepted. Not a drafter for real use."""
from __future__ import annotations

import random


class ReplayProposer:
    def __init__(self, k: int, alpha: float, references: list, seed: int = 0):
        self.k, self.alpha = k, alpha
        self.references = {tuple(p): list(ref) for p, ref in references}
        self.rng = random.Random(seed)

    def retain(self, rids: set[str]) -> None:
        pass

    def propose(self, rids: list[str], seqs: list, caps: list[int]) -> list[list[int]]:
        out = []
        for seq, cap in zip(seqs, caps):
            ref = self.references.get(tuple(seq.prompt_token_ids), [])
            m = len(seq.output_token_ids)
            drafts = []
            for tok in ref[m:m + min(self.k, cap)]:
                drafts.append(tok if self.rng.random() < self.alpha else (tok - 1 if tok > 0 else 1))  # a wrong token
            out.append(drafts)
        return out


"""The engine side of drafters that run in the model runner (methods mtp and eagle3,
kestrel/spec_decode/drafters.py): the runner drafts after each step from the target's hidden states and returns
the drafts with its output (RunnerOutput.next_drafts); this proposer hands them to the next step. Drafts made for a
request whose token count has moved since (a preemption, a stop) are dropped."""
from __future__ import annotations


class RunnerDrafts:
    def __init__(self):
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # req id -> (its token count then, drafts)

    def receive(self, next_drafts: dict[str, tuple[int, list[int]]]) -> None:
        self._drafts.update(next_drafts)

    def retain(self, rids: set[str]) -> None:
        for rid in [r for r in self._drafts if r not in rids]:
            del self._drafts[rid]

    def propose(self, rids: list[str], seqs: list, caps: list[int]) -> list[list[int]]:
        out = []
        for rid, seq, cap in zip(rids, seqs, caps):
            n, drafts = self._drafts.pop(rid, (-1, []))
            out.append(drafts[:cap] if n == len(seq.prompt_token_ids) + len(seq.output_token_ids) else [])
        return out

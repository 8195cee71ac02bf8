"""What the draft-model tests (MTP, EAGLE-3) share: the mixed workload they run with and without speculation (8
random prompts: greedy rows with random lengths, a seeded top-p row, a seeded row with a repetition penalty, a row
with logprobs), and a spy on the drafts."""
from __future__ import annotations

import random

from kestrel import SamplingParams


def workload(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(4, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 24), ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    params[2] = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    params[3] = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    return prompts, params


def tokens(llm, prompts, params):
    """Each request's outputs' token ids; no KV block is left allocated (none leaked by rolled-back drafts)."""
    outs = llm.generate(prompts, params)
    core = llm.engine.core
    assert core.kv.num_free_blocks == core.kv.num_blocks
    return [[c.token_ids for c in o.outputs] for o in outs]


def record_drafts_from_position_0(monkeypatch, drafter_cls) -> list:
    """Make the drafter record (the window's tokens, the drafts) of every proposal from a window that starts at
    position 0 (the whole sequence: nothing truncated), so a test can recompute them from the tokens alone."""
    seen = []
    propose = drafter_cls.propose

    def recording(self, rids):
        starts = {rid: int(self.windows[rid][0][0]) for rid in rids if rid in self.windows}
        drafts = propose(self, rids)
        seen.extend((self.windows[rid][2].tolist(), drafts[rid]) for rid, s in starts.items() if s == 0)
        return drafts

    monkeypatch.setattr(drafter_cls, "propose", recording)
    return seen

"""The n-gram proposer's batched numpy search against a plain per-request loop, and the accept rule."""
import random

import numpy as np
import pytest

from kestrel.spec_decode.ngram import NgramProposer, propose_ngram
from kestrel.spec_decode.verify import accept


def reference_lookup(tokens: list[int], cap: int, n_min: int, n_max: int) -> list[int]:
    """Longest suffix first, then its earliest earlier occurrence; the tokens after it."""
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + cap]
    return []


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 5), (1, 4), (3, 3)])
def test_batched_search_matches_per_request_loop(n_min, n_max):
    rng = random.Random(n_min * 10 + n_max)
    rows = []
    for _ in range(200):
        vocab = rng.choice([3, 5, 20])  # small vocabularies repeat n-grams often
        rows.append([rng.randrange(vocab) for _ in range(rng.randint(0, 40))])
    caps = [rng.randint(0, 6) for _ in rows]
    got = propose_ngram([np.array(r, dtype=np.int64) for r in rows], caps, n_min, n_max)
    want = [reference_lookup(r, c, n_min, n_max) if c > 0 else [] for r, c in zip(rows, caps)]
    assert got == want
    assert sum(1 for g in got if g) > 25  # the case is not vacuous


class Seq:
    def __init__(self, prompt, out):
        self.prompt_token_ids, self.output_token_ids = prompt, out

    def tokens_slice(self, a, b):
        return (self.prompt_token_ids + self.output_token_ids)[a:b]


def test_histories_follow_growing_requests_and_drop_ended_ones():
    p = NgramProposer(k=3, n_min=2, n_max=3)
    s = Seq([1, 2, 3, 4, 1, 2], [])
    assert p.propose(["a"], [s], [3]) == [[3, 4, 1]]
    s.output_token_ids += [3, 9, 1, 2]  # the request grew: only the new tokens are appended
    assert p.propose(["a"], [s], [2]) == [[3, 4]]
    p.retain(set())
    assert p.histories._arrays == {}


def test_accept_rule():
    assert accept(5, [6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, then the bonus token
    assert accept(5, [6, 7, 8], [5, 9, 7]) == [5, 6]  # y_1 = 6 differs from d_1 = 9: emitted, then stop
    assert accept(4, [6, 7, 8], [5, 6, 7]) == [4]
    assert accept(5, [], []) == [5]

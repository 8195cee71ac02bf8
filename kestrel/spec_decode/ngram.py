"""N-gram prompt lookup: find the request's last n tokens earlier in its own tokens (longest n in
[prompt_lookup_min, prompt_lookup_max] first, earliest occurrence) and propose the tokens that followed them.
No weights and no device work; one numpy pass over the whole batch (rows right-aligned in one padded array)."""
from __future__ import annotations

import numpy as np

_PAD = -1  # never equal to a token id


class TokenHistories:
    """Each request's tokens as a growing numpy array, so a step appends only its new tokens (a request's
    tokens only grow while it lives; outputs are kept across preemption)."""

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}
        self._lens: dict[str, int] = {}

    def get(self, rid: str, seq) -> np.ndarray:
        """The tokens of `seq` (a TokenSequence: prompt + outputs) of request `rid`."""
        n = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        arr, have = self._arrays.get(rid), self._lens.get(rid, 0)
        if arr is None or have > n:
            arr, have = np.empty(max(64, 2 * n), dtype=np.int64), 0
        elif len(arr) < n:
            arr = np.concatenate([arr[:have], np.empty(2 * n - have, dtype=np.int64)])
        if have < n:
            arr[have:n] = seq.tokens_slice(have, n)
        self._arrays[rid], self._lens[rid] = arr, n
        return arr[:n]

    def retain(self, rids: set[str]) -> None:
        """Drop the histories of requests not in `rids` (finished, aborted or preempted ones)."""
        for rid in [r for r in self._arrays if r not in rids]:
            del self._arrays[rid], self._lens[rid]


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int, max_lookback: int = 8192):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.max_lookback = max_lookback  # only the last this many tokens are searched (bounds the cost)
        self.histories = TokenHistories()

    def retain(self, rids: set[str]) -> None:
        self.histories.retain(rids)

    def propose(self, rids: list[str], seqs: list, caps: list[int]) -> list[list[int]]:
        """Up to min(k, cap) draft tokens for each request (a TokenSequence); [] where nothing matches."""
        tokens = [self.histories.get(rid, s)[-self.max_lookback:] for rid, s in zip(rids, seqs)]
        return propose_ngram(tokens, [min(self.k, c) for c in caps], self.n_min, self.n_max)


def propose_ngram(tokens: list[np.ndarray], caps: list[int], n_min: int, n_max: int) -> list[list[int]]:
    """For each row: the tokens after the earliest earlier occurrence of its longest matching suffix (length
    n_max down to n_min), at most caps[row] of them."""
    out: list[list[int]] = [[] for _ in tokens]
    rows = [b for b, t in enumerate(tokens) if caps[b] > 0 and len(t) > n_min]
    if not rows:
        return out
    length = max(len(tokens[b]) for b in rows)
    width = n_max + length  # n_max pad columns in front, so every window start is a valid column
    arr = np.full((len(rows), width), _PAD, dtype=np.int64)
    for i, b in enumerate(rows):
        arr[i, width - len(tokens[b]):] = tokens[b]
    # match[:, e]: the window ending at column e equals the suffix, over the last n tokens (grown n = 1, 2, ...);
    # e runs over every column but the last (the suffix itself)
    last = width - 1
    match = np.ones((len(rows), last), dtype=bool)
    found = np.zeros(len(rows), dtype=bool)
    cols = np.full(len(rows), -1, dtype=np.int64)
    for n in range(1, n_max + 1):
        match[:, n - 1:] &= arr[:, :last - n + 1] == arr[:, last - n + 1:last - n + 2]
        match[:, :n - 1] = False
        if n >= n_min:  # a longer n found later overwrites: the longest match wins
            hit = match.any(axis=1)
            cols[hit] = match[hit].argmax(axis=1)  # its earliest window end
            found |= hit
    for i, b in enumerate(rows):
        if found[i]:
            start = cols[i] + 1
            out[b] = arr[i, start:min(start + caps[b], width)].tolist()
    return out

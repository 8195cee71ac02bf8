"""Per-request logit changes before sampling: OpenAI's `logit_bias`, vLLM's `allowed_token_ids` and `bad_words`.

Each request's fixed part (its biases, its single-token bad words) is laid out once, when the request arrives; a
step gathers the rows that use any of them into one sparse (row, token, value) list, added to the logits in one
`index_put_` (a ban is -inf), and masks the `allowed_token_ids` rows in one pass (one keep-mask a list, built at
its first step and shared by the sequences that share the list). A step whose rows use none of
them costs a dictionary lookup per row; with no such request live, nothing at all. A multi-token bad word bans
its last token where the output so far ends with the rest of it (only output tokens count, as in vLLM); such
requests never run pipelined (engine/scheduler.py needs_sync), so their previous tokens are known here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.core.device import to_device
from kestrel.worker.addons.base import StepAddon
from kestrel.worker.input_batch import RequestState

_BAN = float("-inf")


@dataclass
class _LogitChanges:
    tokens: list[int]  # fixed changes: biased tokens and single-token bad words
    values: list[float]
    allowed: list[int] | None  # the only tokens it may sample (None: any)
    prefixed_bans: list[tuple[list[int], int]]  # (preceding output tokens, banned token) of multi-token bad words

    @classmethod
    def of(cls, st: RequestState) -> "_LogitChanges":
        p = st.sampling_params
        bias = dict(p.logit_bias or {})
        prefixed = []
        for word in p.bad_words_token_ids or ():
            if len(word) == 1:
                bias[word[0]] = _BAN
            else:
                prefixed.append((word[:-1], word[-1]))
        return cls(list(bias), list(bias.values()), p.allowed_token_ids, prefixed)

    def bans(self, output: list[int]) -> list[int]:
        """The tokens its bad words ban after `output`."""
        return [last for prefix, last in self.prefixed_bans
                if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix]


class LogitsBias(StepAddon):
    def __init__(self):
        self.changes: dict[str, _LogitChanges] = {}  # live requests that change their logits
        # one keep-mask per allowed_token_ids list object (a request's sequences share theirs: engine/core.py):
        # id(list) -> [the list, its mask (built at first use) or None, live requests using it]
        self._masks: dict[int, list] = {}

    def add_request(self, st: RequestState) -> None:
        if st.sampling_params.changes_logits:
            ch = self.changes[st.request_id] = _LogitChanges.of(st)
            if ch.allowed is not None:
                self._masks.setdefault(id(ch.allowed), [ch.allowed, None, 0])[2] += 1

    def remove_request(self, st: RequestState) -> None:
        ch = self.changes.pop(st.request_id, None)
        if ch is not None and ch.allowed is not None:
            entry = self._masks[id(ch.allowed)]
            entry[2] -= 1
            if not entry[2]:
                del self._masks[id(ch.allowed)]

    def _mask(self, allowed: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The vocabulary-wide keep-mask of one allowed_token_ids list, built once on the logits' device."""
        entry = self._masks[id(allowed)]
        mask = entry[1]
        if mask is None or mask.device != logits.device or mask.shape[0] != logits.shape[1]:
            mask = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            mask[to_device(allowed, torch.int64, logits.device)] = True
            entry[1] = mask
        return mask

    def before_sample(self, logits: torch.Tensor, inf) -> None:
        if not self.changes:
            return
        rows, tokens, values = [], [], []
        allow_rows, allow_masks = [], []  # restricted rows and their keep-masks
        for i, st in enumerate(inf.states):
            ch = self.changes.get(st.request_id)
            if ch is None:
                continue
            banned = ch.bans(st.output_token_ids) if ch.prefixed_bans else []
            rows += [i] * (len(ch.tokens) + len(banned))
            tokens += ch.tokens + banned
            values += ch.values + [_BAN] * len(banned)
            if ch.allowed is not None:
                allow_rows.append(i)
                allow_masks.append(self._mask(ch.allowed, logits))
        dev = logits.device
        if allow_rows:
            keep_only(logits, to_device(allow_rows, torch.int64, dev), torch.stack(allow_masks))
        if rows:
            logits.index_put_((to_device(rows, torch.int64, dev), to_device(tokens, torch.int64, dev)),
                              to_device(values, torch.float32, dev).to(logits.dtype), accumulate=True)


def keep_only(logits: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """Ban every token of the logits rows `rows` except those `keep` (one vocabulary-wide mask a row) marks."""
    logits[rows] = logits[rows].masked_fill(~keep, _BAN)

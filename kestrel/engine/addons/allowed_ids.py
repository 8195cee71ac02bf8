"""Shared allowed_token_ids, an engine add-on: a request's n sequences (and prompts) arrive one after another,
each with its own decoded copy of allowed_token_ids (up to the vocabulary size each: 64 sequences of a large list
held gigabytes). A copy equal to the previous request's list of the same group becomes that list, so they share
one object (the runner's LogitsBias then builds one mask for them all)."""
from __future__ import annotations

from kestrel.core.engine_addon import EngineAddon


class SharedAllowedIds(EngineAddon):
    name = "allowed_ids"

    def __init__(self):
        self._last: tuple[str, list[int]] | None = None  # the last request's (group, allowed_token_ids)

    def admit(self, req) -> None:
        params = req.sampling_params
        ids, last = params.allowed_token_ids, self._last
        if ids is None:
            return None
        if last is not None and last[0] == req.group_id and last[1] is not ids and last[1] == ids:
            params.allowed_token_ids = last[1]
        else:
            self._last = (req.group_id, ids)
        return None

"""The Responses API's store: a finished response (store: true) is kept under its id, with the conversation that
led to it and its output as chat messages, so that a request naming it as previous_response_id continues that
conversation (and GET /v1/responses/{id} returns it). In memory, bounded: past --responses-store-size the oldest
response is dropped (0 keeps none). A restart forgets every response."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kestrel.errors import InvalidRequest


class ResponseNotFound(InvalidRequest):
    status_code = 404  # vLLM's answer: 404 with an invalid_request_error body


@dataclass
class StoredResponse:
    messages: list[dict]  # the conversation, in chat-completions form, ending with this response's output
    body: dict  # the response object as it was returned


class ResponseStore:
    def __init__(self, max_size: int):
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict], body: dict) -> None:
        if self.max_size <= 0:
            return
        self._items[response_id] = StoredResponse(messages, body)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response; 404 (as vLLM answers) for an id never stored, dropped, or stored with store off."""
        item = self._items.get(response_id)
        if item is None:
            why = "" if self.max_size > 0 else " (this server keeps no responses: --responses-store-size 0)"
            raise ResponseNotFound(f"Response with id '{response_id}' not found.{why}", param=param)
        return item

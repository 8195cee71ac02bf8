"""The Responses API's store: a finished response (store: true) is kept under its id, with the conversation that
led to it and its output as chat messages, so that a request naming it as previous_response_id continues that
conversation (and GET /v1/responses/{id} returns it). In memory, as compact JSON bytes, bounded by count
(--responses-store-size; 0 keeps none) and by bytes (--responses-store-bytes): the oldest responses are dropped
first, and one larger than the byte bound is not kept. A restart forgets every response.

Each response is bound to its creator, the owner: the API key the request presented (with --api-key) and the
request's `user` field. Only the same owner finds it: anyone else gets the 404 of an unknown id, whether they read
it (GET, with `?user=`), continue it (previous_response_id) or guess its id. The ids are the server's own
(`resp-` and 32 random hex digits): a client's request_id never names a stored response."""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

from kestrel.errors import InvalidRequest


class ResponseNotFound(InvalidRequest):
    status_code = 404  # vLLM's answer: 404 with an invalid_request_error body


def response_owner(authorization: str | None, user: str | None, keyed: bool) -> str:
    """Who a stored response belongs to: a digest of the presented key (when the server has one) and the `user`
    field. Requests without a key and without `user` share the owner "" (their ids are still unguessable)."""
    key = hashlib.sha256((authorization or "").encode()).hexdigest() if keyed else ""
    return json.dumps([key, user or ""])


@dataclass
class StoredResponse:
    owner: str
    data: bytes  # JSON of [messages, body]

    @property
    def messages(self) -> list[dict]:  # the conversation, in chat-completions form, ending with this output
        return json.loads(self.data)[0]

    @property
    def body(self) -> dict:  # the response object as it was returned
        return json.loads(self.data)[1]


class ResponseStore:
    def __init__(self, max_size: int, max_bytes: int = 64 * 2**20):
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict], body: dict, owner: str = "") -> bool:
        """Keep a response (False: not kept, the store is off or it alone is over the byte bound). Ids are the
        server's own and never reused: an id already stored is not overwritten."""
        if self.max_size <= 0 or response_id in self._items:
            return False
        data = json.dumps([messages, body], ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > self.max_bytes:
            return False
        self._items[response_id] = StoredResponse(owner, data)
        self.bytes += len(data)
        while len(self._items) > self.max_size or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old.data)
        return True

    def get(self, response_id: str, param: str = "response_id", owner: str = "") -> StoredResponse:
        """The stored response; 404 (as vLLM answers) for an id never stored, dropped, stored with store off, or
        another owner's."""
        item = self._items.get(response_id)
        if item is None or item.owner != owner:
            why = "" if self.max_size > 0 else " (this server keeps no responses: --responses-store-size 0)"
            raise ResponseNotFound(f"Response with id '{response_id}' not found.{why}", param=param)
        return item

"""The Responses API's pieces without a server: the bounded response store (oldest dropped first, 404 as vLLM
answers, size 0 keeps nothing) and input items as chat messages (consecutive function calls are one turn)."""
from __future__ import annotations

import pytest

from kestrel.errors import InvalidRequest
from kestrel.server.response_items import input_messages
from kestrel.server.response_store import ResponseNotFound, ResponseStore


def test_store_is_bounded_oldest_first():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"resp_{i}", [{"role": "user", "content": str(i)}], {"id": f"resp_{i}"})
    assert len(store) == 2 and store.get("resp_2").body == {"id": "resp_2"}
    with pytest.raises(ResponseNotFound, match="Response with id 'resp_0' not found") as e:
        store.get("resp_0", "previous_response_id")
    assert e.value.status_code == 404 and e.value.param == "previous_response_id"
    off = ResponseStore(0)
    off.put("resp_x", [], {})
    with pytest.raises(ResponseNotFound, match="keeps no responses: --responses-store-size 0"):
        off.get("resp_x")


def test_input_items_as_chat_messages():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "be terse"}]},
             {"type": "message", "role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    assert input_messages(items) == [
        {"role": "system", "content": "be terse"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with pytest.raises(InvalidRequest, match=r"input\[0\].call_id must be a string"):
        input_messages([{"type": "function_call_output", "output": "x"}])


def test_store_stays_within_its_byte_bound_oldest_first():
    """Issue 55: bounded by count only, a 6.7 MB metadata body cost ~35 MB; now the store holds JSON bytes under
    --responses-store-bytes, dropping the oldest, and keeps none alone over the bound."""
    store = ResponseStore(1000, max_bytes=200_000)
    big = "x" * 20_000
    for i in range(1000):
        assert store.put(f"resp-{i}", [{"role": "user", "content": big}], {"id": f"resp-{i}", "metadata": {}})
        assert store.bytes <= 200_000 and store.bytes == sum(len(v.data) for v in store._items.values())
    assert 5 <= len(store) <= 10 and store.get("resp-999").body["id"] == "resp-999"
    with pytest.raises(ResponseNotFound):
        store.get("resp-0")
    assert not store.put("resp-huge", [{"role": "user", "content": "y" * 300_000}], {})
    assert store.get("resp-999").messages == [{"role": "user", "content": big}]


def test_store_is_bound_to_its_owner_and_never_overwritten():
    from kestrel.server.response_store import response_owner

    alice, bob = response_owner(None, "alice", False), response_owner(None, "bob", False)
    anon = response_owner(None, None, False)
    assert len({alice, bob, anon}) == 3
    k1, k2 = response_owner("Bearer k1", None, True), response_owner("Bearer k2", None, True)
    assert k1 != k2 and "k1" not in k1  # the key is kept as a digest, never in clear
    store = ResponseStore(10)
    assert store.put("resp-a", [], {"id": "resp-a", "v": 1}, alice)
    assert not store.put("resp-a", [], {"id": "resp-a", "v": 2}, bob)  # an id is never overwritten
    for who in (bob, anon):
        with pytest.raises(ResponseNotFound, match="'resp-a' not found"):
            store.get("resp-a", owner=who)
    assert store.get("resp-a", owner=alice).body == {"id": "resp-a", "v": 1}

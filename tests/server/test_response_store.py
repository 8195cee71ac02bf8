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

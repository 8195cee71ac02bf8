"""The Responses API's items in and out of chat-completions form, so that /v1/responses runs on the chat path
(template, tools, structured outputs): input items (message, reasoning, function_call, function_call_output) become
chat messages; Responses function tools and tool_choice become chat tools; the assistant's reply (its reasoning,
text and tool calls) becomes output items (reasoning, message, function_call)."""
from __future__ import annotations

import uuid

from kestrel.errors import InvalidRequest

INPUT_TEXT_TYPES = ("input_text", "output_text", "text")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_FORMATS = ("text", "json_object", "json_schema")


def _user_content(content, where: str):
    """A user / system message's content: its text, or, where it holds input_image parts, chat content parts
    (text and image_url) for the chat path's image handling."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of(content, where)
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequest(f"{where}: an input_image part needs image_url (a URL or a data: URL); "
                                     f"file_id is not supported", param="input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], where)})
    return parts


def text_response_format(text: dict | None) -> dict | None:
    """The Responses `text.format` as the chat API's response_format: json_schema {name, schema, strict} or
    json_object (structured output), text (none)."""
    if text is None:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise InvalidRequest(f"text.{sorted(unknown)[0]} is not supported", param="text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TEXT_FORMATS:
        raise InvalidRequest(f"text.format.type must be one of {', '.join(TEXT_FORMATS)}", param="text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("text.format with type json_schema needs a `schema` object", param="text")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response", "schema": fmt["schema"],
                                                   "strict": bool(fmt.get("strict", False))}}


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in INPUT_TEXT_TYPES or not isinstance(
                part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{where}: content part {kind!r} is not supported (text parts, and input_image "
                                 f"in user messages)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{name} must be a string", param="input")
    return value


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages. Consecutive function_call items are one assistant turn with several calls; a
    reasoning item is the reasoning_content of the assistant turn that follows it (a message or calls)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise InvalidRequest("input is empty", param="input")
    messages: list[dict] = []
    reasoning: list[str] = []  # reasoning items waiting for their assistant turn

    def assistant(turn: dict) -> dict:
        if reasoning:
            turn["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        messages.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            assistant({"role": "assistant", "content": _text_of(item.get("content"), where)})
        elif kind == "message" and item.get("role") in MESSAGE_ROLES:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _user_content(item.get("content"), where)})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if (last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]
                    and not reasoning):
                last["tool_calls"].append(call)
            else:
                assistant({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        else:
            raise InvalidRequest(f"{where}: only message (role user, assistant, system or developer), reasoning, "
                                 f"function_call and function_call_output items are supported, got type {kind!r}",
                                 param="input")
    if reasoning:
        raise InvalidRequest("a reasoning item must be followed by the assistant message or function_call it led to",
                             param="input")
    return messages


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content (what we send), else its summary."""
    if item.get("encrypted_content") is not None:
        raise InvalidRequest(f"{where}: encrypted reasoning is not supported (send its content)", param="input")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                              for p in parts):
        raise InvalidRequest(f"{where}: a reasoning item's content must be a list of reasoning_text parts",
                             param="input")
    return "".join(p["text"] for p in parts)


def chat_tools(tools: list | None) -> list[dict] | None:
    """Responses function tools ({type, name, description, parameters}) as chat tools."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise InvalidRequest(f"tools[{i}]: only function tools are supported, got type {kind!r}", param="tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                     if t.get(k) is not None}})
    return out


def chat_tool_choice(choice):
    """"auto" | "none" | "required" | {"type": "function", "name": F} as the chat API spells it."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "name": '
                                 '...}', param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    content = ([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
               if status != "in_progress" else [])
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """The reasoning (a reasoning parser's reasoning_content) as a Responses reasoning item, its text whole."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "encrypted_content": None,
            "status": status}


def function_call_item(call: dict, status: str = "completed") -> dict:
    """A chat tool call ({id, function: {name, arguments}}) as a Responses function_call item."""
    return {"type": "function_call", "id": new_item_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status != "in_progress" else "", "status": status}


def output_items(message: dict, message_id: str, status: str, include_reasoning: bool = True) -> list[dict]:
    """The assistant's chat message (reasoning_content, content, tool_calls) as output items: its reasoning (if any
    and asked for), its text (if any, or if it made no call) then one function_call per call."""
    calls = message.get("tool_calls") or []
    items = [reasoning_item(new_item_id("rs"), message["reasoning_content"], status)] \
        if include_reasoning and message.get("reasoning_content") is not None else []
    if message.get("content") or not calls:
        items.append(message_item(message_id, message.get("content") or "", status))
    return items + [function_call_item(c) for c in calls]


def assistant_message(message: dict) -> dict:
    """The reply as the next turn's history: its reasoning, content and the calls it made (gpt-oss's template
    keeps a calling turn's analysis until the final answer)."""
    turn = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content") is not None:
        turn["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        turn["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                              for c in message["tool_calls"]]
    return turn

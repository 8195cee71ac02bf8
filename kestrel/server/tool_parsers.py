"""Tool-call parsers (--tool-call-parser): find the function calls in a model's output text, whole or as streamed
deltas in the shape OpenAI streams them (a call's first delta carries its index, id, type and name with empty
arguments; later deltas carry pieces of the arguments JSON text).

  hermes    <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number (Hermes 2/3, Qwen2.5, Qwen3)
  llama3_json  {"name": ..., "parameters": {...}} objects separated by ';', optionally after <|python_tag|>
                (Llama 3.1/3.2/3.3 JSON tool calling); output that does not start with one is plain content

Both share one streaming engine: a parser says where the call regions are in the text so far; each region's
name is sent once known, and its arguments as raw text as it grows (trailing '}' and whitespace are held back
until they are known to belong to the arguments, so the pieces always concatenate to the final arguments)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Region:
    text: str  # the call's JSON text (so far)
    complete: bool


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _call_of(region: str) -> ToolCall | None:
    """A complete region as a call, or None where it is not one (bad JSON, no name)."""
    try:
        obj = json.loads(region)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _streamable(region: Region) -> tuple[str | None, str | None]:
    """(name, arguments text so far) of a region; arguments only once the name is known and came first."""
    m = _NAME.search(region.text)
    name = json.loads(f'"{m.group(1)}"') if m else None
    a = _ARGS.search(region.text)
    if name is None or a is None:
        return name, None
    if a.start() < m.start():  # arguments before the name: only the complete region says where they end
        if not region.complete:
            return name, None
    start = a.end()
    if region.complete:
        try:
            value, end = _DECODER.raw_decode(region.text, start)
        except ValueError:
            return name, None
        return name, (region.text[start:end] if not isinstance(value, str) else value)
    return name, region.text[start:].rstrip().rstrip("}").rstrip()  # hold back what may close the wrapper


class ToolParser:
    name = ""

    def scan(self, text: str, final: bool) -> tuple[list[tuple[int, int]], list[Region], bool]:
        """(content spans safe to emit, call regions, undecided) of the text so far."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; text whose calls do not parse stays content."""
        spans, regions, _ = self.scan(text, final=True)
        calls = [_call_of(r.text) for r in regions if r.complete]
        if not regions or any(c is None for c in calls) or not calls:
            return text, []
        content = "".join(text[a:b] for a, b in spans).strip()
        return content or None, calls

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text, final):
        spans, regions, pos = [], [], 0
        while True:
            i = text.find(self.OPEN, pos)
            if i < 0:
                hold = 0 if final else _partial_suffix(text[pos:], self.OPEN)
                spans.append((pos, len(text) - hold))
                return spans, regions, False
            spans.append((pos, i))
            j = text.find(self.CLOSE, i)
            if j < 0:
                body = text[i + len(self.OPEN):]
                hold = 0 if final else _partial_suffix(body, self.CLOSE)
                regions.append(Region(body[:len(body) - hold].strip(), final))
                return spans, regions, False
            regions.append(Region(text[i + len(self.OPEN):j].strip(), True))
            pos = j + len(self.CLOSE)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def scan(self, text, final):
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        elif not body or (self.TAG.startswith(body) and not final):
            return [], [], True  # nothing to say yet
        if not body.strip() and not final:
            return [], [], True
        if not body.lstrip().startswith("{"):
            return [(0, len(text))], [], False
        regions, pos = [], 0
        while pos < len(body):
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
            if pos >= len(body):
                break
            try:
                _, end = _DECODER.raw_decode(body, pos)
                regions.append(Region(body[pos:end], True))
                pos = end
            except ValueError:
                regions.append(Region(body[pos:], final))
                break
        if final and not all(_call_of(r.text) for r in regions):
            return [(0, len(text))], [], False  # JSON that is not calls: plain content
        undecided = not final and not any(_NAME.search(r.text) for r in regions)
        return [], regions, undecided


class ToolCallStream:
    """One choice's streaming state: feed text deltas, get (content delta, tool-call deltas)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.content_sent = 0  # characters of content (in span order) already sent
        self.calls: list[tuple[str, str]] = []  # per sent call: (id, arguments sent)

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        spans, regions, undecided = self.parser.scan(self.text, final)
        if undecided:
            return "", []
        if final and regions and not self.calls and not any(_streamable(r)[0] for r in regions):
            spans, regions = [(0, len(self.text))], []  # never became a call: it was content
        content = "".join(self.text[a:b] for a, b in spans)
        content_delta = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        if self.calls or regions:
            content_delta = content_delta if content_delta.strip() else ""
        deltas = []
        for k, region in enumerate(regions):
            name, args = _streamable(region)
            if name is None:
                break
            if k == len(self.calls):
                call_id = new_call_id()
                self.calls.append((call_id, ""))
                deltas.append({"index": k, "id": call_id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            call_id, sent = self.calls[k]
            if args is not None and len(args) > len(sent) and args.startswith(sent):
                deltas.append({"index": k, "function": {"arguments": args[len(sent):]}})
                self.calls[k] = (call_id, args)
        return content_delta, deltas


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str | None) -> ToolParser | None:
    if not name:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()

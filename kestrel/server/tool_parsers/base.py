"""What every tool-call parser shares: a parser says where the calls are in the output text so far (scan), as
regions with the function's name once known and the arguments JSON text so far; one streaming engine
(ToolCallStream) turns successive scans into OpenAI's deltas (a call's first delta carries its index, id, type
and name with empty arguments; later deltas carry pieces of the arguments JSON text). A region's arguments only
ever grow (what may still change, such as a closing brace or trailing white space, is held back), so the pieces
always concatenate to the final arguments. Helpers below build regions from the common shapes: a JSON object
with name and arguments, a name with raw JSON arguments, a name with XML-style parameters converted by the tool's
JSON schema."""
from __future__ import annotations

import ast
import copy
import json
import re
import uuid
from dataclasses import dataclass, field

from kestrel.server.markers import blocks

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
    """One call in the output so far."""
    name: str | None  # None until known
    args: str | None  # the arguments JSON text so far (each later scan's extends it); None until they start
    complete: bool
    valid: bool = True  # a complete region that is a real call (its arguments parse)
    call_id: str | None = None  # the model's own id for the call (Kimi K2), else one is made


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def json_object_region(text: str, complete: bool) -> Region:
    """{"name": ..., "arguments" (or "parameters"): {...}} (Hermes, Llama 3 JSON, Mistral's and Granite's lists)."""
    m = _NAME.search(text)
    name = json.loads(f'"{m.group(1)}"') if m else None
    if complete:
        try:
            obj = json.loads(text)
        except ValueError:
            return Region(name, None, True, valid=False)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return Region(name, None, True, valid=False)
        name = obj["name"]
    a = _ARGS.search(text)
    if name is None or a is None:
        return Region(name, "{}" if complete else None, complete)
    if m is not None and a.start() < m.start() and not complete:  # arguments before the name: only the whole object says where they end
        return Region(name, None, False)
    start = a.end()
    if complete:
        value, end = _DECODER.raw_decode(text, start)
        return Region(name, value if isinstance(value, str) else text[start:end], True)
    return Region(name, text[start:].rstrip().rstrip("}").rstrip(), False)  # hold back what may close the wrapper


def json_sequence(body: str, final: bool, separators: str) -> list[Region]:
    """JSON call objects one after the other (between them: `separators` characters; a ']' ends the list)."""
    regions, pos = [], 0
    while pos < len(body):
        while pos < len(body) and body[pos] in separators:
            pos += 1
        if pos >= len(body) or body[pos] == "]":
            break
        try:
            _, end = _DECODER.raw_decode(body, pos)
            regions.append(json_object_region(body[pos:end], True))
            pos = end
        except ValueError:
            regions.append(json_object_region(body[pos:], final))
            break
    return regions


def raw_json_region(name: str | None, args: str | None, complete: bool, call_id: str | None = None) -> Region:
    """A name and its arguments' JSON text as the model writes it (white space around it dropped)."""
    if args is None:
        return Region(name, "{}" if complete else None, complete, call_id=call_id)
    args = args.strip() if complete else args.lstrip().rstrip()
    if complete:
        args = args or "{}"
        return Region(name, args, True, valid=is_json(args), call_id=call_id)
    return Region(name, args, False, call_id=call_id)


# JSON schema type names as models' templates write them, the way vLLM's XML-style parsers read them
_STRING = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER = {"integer", "int"}
_NUMBER = {"number", "float", "double"}
_BOOLEAN = {"boolean", "bool", "binary"}


def param_types(tools: list[dict] | None, name: str | None) -> dict[str, str]:
    """Parameter name -> its JSON schema type (first non-null one) for the tool `name`."""
    for t in tools or []:
        fn = t.get("function", {})
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            out = {}
            for k, spec in props.items():
                kind = spec.get("type") if isinstance(spec, dict) else None
                if kind is None and isinstance(spec, dict):
                    kind = next((s.get("type") for s in spec.get("anyOf", spec.get("oneOf", []))
                                 if isinstance(s, dict) and s.get("type") not in (None, "null")), None)
                if isinstance(kind, list):
                    kind = next((k2 for k2 in kind if k2 != "null"), "string")
                out[k] = str(kind).lower() if kind else "object"
            return out
    return {}


def convert_value(raw: str, kind: str | None, untyped: str = "string"):
    """A parameter's text as the JSON value its schema type says (a parameter the schema does not name: a string,
    or with untyped="json" whatever JSON it parses as)."""
    if raw.lower() == "null":
        return None
    kind = kind or ("string" if untyped == "string" else "object")
    if kind in _STRING:
        return raw
    try:
        if kind in _INTEGER:
            return int(raw.strip())
        if kind in _NUMBER:
            number = float(raw.strip())
            return int(number) if number.is_integer() and not re.search(r"[.eE]", raw) else number
    except ValueError:
        return raw
    if kind in _BOOLEAN:
        return raw.strip().lower() == "true"
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return ast.literal_eval(raw)  # Python literals (True, 'quoted'): parsed, never run
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def params_region(name: str | None, params: list[tuple[str, str, bool]], complete: bool, tools: list[dict] | None,
                  untyped: str = "string") -> Region:
    """A call whose parameters come one by one as (key, value text, value complete) (the XML-style formats): the
    arguments JSON grows a parameter at a time, and a string parameter's text as it is written."""
    if name is None:
        return Region(None, None, complete)
    types = param_types(tools, name)
    parts = []
    for key, raw, done in params:
        if raw.startswith("\n"):
            raw = raw[1:]
        kind = types.get(key, "string" if untyped == "string" else None)
        head = f"{json.dumps(key, ensure_ascii=False)}: "
        if done or complete:
            raw = raw[:-1] if raw.endswith("\n") else raw
            parts.append(head + json.dumps(convert_value(raw, kind, untyped), ensure_ascii=False))
            continue
        raw = raw[:-1] if raw.endswith("\n") else raw  # may be the newline before the closing tag
        if kind in _STRING and not "null".startswith(raw.lower()):
            parts.append(head + json.dumps(raw, ensure_ascii=False)[:-1])  # the string so far, unclosed
        break
    args = "{" + ", ".join(parts) + ("}" if complete else "")
    return Region(name, args, complete, valid=not complete or is_json(args))


class ToolParser:
    name = ""
    keeps_special_tokens = False  # its markers are special tokens of the model's vocabulary: decode them
    framed = False  # all output is in the format's frames (harmony): content is what the spans say, calls or not
    tools: list[dict] | None = None  # the request's tools (for schema types), bound by for_request

    def for_request(self, tools: list[dict] | None) -> "ToolParser":
        bound = copy.copy(self)
        bound.tools = tools
        return bound

    def scan(self, text: str, final: bool) -> tuple[list[tuple[int, int]], list[Region], bool]:
        """(content spans safe to emit, call regions, undecided) of the text so far."""
        raise NotImplementedError

    def new_id(self) -> str:
        return new_call_id()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; text whose calls do not parse stays content."""
        spans, regions, _ = self.scan(text, final=True)
        if not regions and self.framed:
            return "".join(text[a:b] for a, b in spans) or None, []
        if not regions or any(not r.valid or r.name is None or r.args is None for r in regions):
            return text, []
        content = "".join(text[a:b] for a, b in spans).strip()
        return content or None, [ToolCall(r.name, r.args, r.call_id or self.new_id()) for r in regions]

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


class BlockToolParser(ToolParser):
    """Calls between an opening and a closing tag, any number, content around them (Hermes and its kin); a
    subclass reads one call's body (call)."""
    OPEN = CLOSE = ""

    def call(self, body: str, complete: bool) -> Region:
        raise NotImplementedError

    def scan(self, text, final):
        spans, bodies = blocks(text, self.OPEN, self.CLOSE, final)
        return spans, [self.call(body, done) for body, done in bodies], False


class SectionToolParser(ToolParser):
    """Calls inside a section, each between a call's opening and closing tags (DeepSeek, Kimi K2, MiniMax M2):
    TAGS = (section open, section close, call open, call close); the content is what stands outside the
    sections. Their tags are special tokens."""
    TAGS = ("", "", "", "")
    keeps_special_tokens = True

    def call(self, body: str, complete: bool) -> Region:
        raise NotImplementedError

    def section_open(self, text: str) -> str:
        return self.TAGS[0]

    def scan(self, text, final):
        spans, sections = blocks(text, self.section_open(text), self.TAGS[1], final)
        regions = []
        for section, closed in sections:
            _, calls = blocks(section, self.TAGS[2], self.TAGS[3], closed)
            regions += [self.call(body, done) for body, done in calls]
        return spans, regions, False


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
        if final and regions and not self.calls and not any(r.name for r in regions):
            spans, regions = [(0, len(self.text))], []  # never became a call: it was content
        content = "".join(self.text[a:b] for a, b in spans)
        content_delta = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        if self.calls or regions:
            content_delta = content_delta if content_delta.strip() else ""
        deltas = []
        for k, region in enumerate(regions):
            if region.name is None:
                break
            if k == len(self.calls):
                call_id = region.call_id or self.parser.new_id()
                self.calls.append((call_id, ""))
                deltas.append({"index": k, "id": call_id, "type": "function",
                               "function": {"name": region.name, "arguments": ""}})
            call_id, sent = self.calls[k]
            args = region.args
            if args is not None and len(args) > len(sent) and args.startswith(sent):
                deltas.append({"index": k, "function": {"arguments": args[len(sent):]}})
                self.calls[k] = (call_id, args)
        return content_delta, deltas


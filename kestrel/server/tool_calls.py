"""Chat tool calling: validates `tools` / `tool_choice`, decides how calls come out of the model, and turns the
output text (whole or streamed) into OpenAI message fields.

  none      the model answers in text (tools still reach the chat template)
  auto      the model may call: the --tool-call-parser finds the calls (needs --enable-auto-tool-choice)
  required  at least one call: the output is constrained to a JSON array of {name, parameters} (structured outputs)
  named     {"type": "function", "function": {"name": F}}: the output is constrained to F's parameters schema
A reasoning parser, when set, takes the <think> part out first (reasoning_content)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from kestrel.core.sampling_params import StructuredOutputsParams
from kestrel.errors import InvalidRequest
from kestrel.server.reasoning import ReasoningParser
from kestrel.server.tool_parsers import ToolCall, ToolParser, new_call_id

ANY_OBJECT = {"type": "object"}


def _check_tools(tools: list) -> list[dict]:
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters", ANY_OBJECT)
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)  # for the chat template
    named: str | None = None
    structured: StructuredOutputsParams | None = None
    parser: ToolParser | None = None

    @property
    def makes_calls(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def reasoning_for(self, parser: ReasoningParser | None, chat_template_kwargs: dict | None,
                      params) -> ReasoningParser | None:
        """The request's reasoning parser (or None); where this request's parsers read markers that are special
        tokens, its output is decoded with them (params.skip_special_tokens off, as vLLM's parsers ask)."""
        reasoning = parser.for_request(chat_template_kwargs) if parser is not None else None
        if (self.parser is not None and self.parser.keeps_special_tokens) or (
                reasoning is not None and reasoning.keeps_special_tokens):
            params.skip_special_tokens = False
        return reasoning


def plan_tools(tools: list | None, tool_choice, parser: ToolParser | None, auto_enabled: bool,
               parallel: bool = True) -> ToolPlan:
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    tools = _check_tools(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise InvalidRequest('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                                 '--tool-call-parser', param="tool_choice")
        return ToolPlan("auto", tools, parser=parser.for_request(tools))
    if choice == "required":
        variants = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                      "parameters": t["function"]["parameters"]},
                     "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, structured=_constraint(schema))
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (choice.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)):
            raise InvalidRequest('tool_choice must be {"type": "function", "function": {"name": ...}} to name a '
                                 'function', param="tool_choice")
        name = fn["name"]
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan("named", tools, named=name, structured=_constraint(match[0]["function"]["parameters"]))
    raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}', param="tool_choice")


def _constraint(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema).validate("tools", parse=False)  # parsed off the loop: grammar_check.py


def _required_calls(text: str) -> list[ToolCall]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in items if isinstance(c, dict) and isinstance(c.get("name"), str)]


def build_message(plan: ToolPlan, reasoning: ReasoningParser | None, text: str, finish_reason: str | None
                  ) -> tuple[dict, str | None]:
    """(assistant message, finish_reason) of a whole output."""
    msg: dict = {"role": "assistant"}
    content: str | None = text
    if reasoning is not None:
        msg["reasoning_content"], content = reasoning.extract(text)
    calls: list[ToolCall] = []
    if plan.mode == "auto":
        content, calls = plan.parser.extract(content or "")
    elif plan.mode == "named":
        calls, content = [ToolCall(plan.named, content or "")], None
    elif plan.mode == "required":
        calls = _required_calls(content or "")
        content = None if calls else content
    msg["content"] = content
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
        if plan.mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
    elif plan.makes_calls:
        msg["tool_calls"] = []
    return msg, finish_reason


class MessageStream:
    """One choice's streamed deltas: reasoning_content, content and tool_calls pieces, as OpenAI sends them."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None):
        self.plan = plan
        self.reasoning = reasoning.stream() if reasoning is not None else None
        self.tools = plan.parser.stream() if plan.mode == "auto" else None
        self.named_id: str | None = None
        self.buffer = ""  # required: the JSON array, parsed when complete
        self.num_calls = 0

    def feed(self, text_delta: str, final: bool) -> dict:
        delta: dict = {}
        content = text_delta
        if self.reasoning is not None:
            r, content = self.reasoning.feed(text_delta, final)
            if r:
                delta["reasoning_content"] = r
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            self.num_calls = self.tools.num_calls
        elif self.plan.mode == "named":
            if self.named_id is None:
                self.named_id = new_call_id()
                calls.append({"index": 0, "id": self.named_id, "type": "function",
                              "function": {"name": self.plan.named, "arguments": ""}})
            if content:
                calls.append({"index": 0, "function": {"arguments": content}})
            content, self.num_calls = "", 1
        elif self.plan.mode == "required":
            self.buffer += content
            content = ""
            if final:
                for k, c in enumerate(_required_calls(self.buffer)):
                    calls.append({"index": k, "id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}})
                self.num_calls = len(calls)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.num_calls and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason

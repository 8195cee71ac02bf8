"""Tool-call parsers (--tool-call-parser), by vLLM's names: find the function calls in a model's output text,
whole or as streamed deltas. One file a format (base.py: what they share), registered here."""
from __future__ import annotations

from kestrel.server.markers import lookup
from kestrel.server.tool_parsers.base import Region, ToolCall, ToolCallStream, ToolParser, new_call_id
from kestrel.server.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from kestrel.server.tool_parsers.glm45 import Glm45ToolParser
from kestrel.server.tool_parsers.granite import GraniteToolParser
from kestrel.server.tool_parsers.hermes import HermesToolParser
from kestrel.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from kestrel.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kestrel.server.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from kestrel.server.tool_parsers.mistral import MistralToolParser
from kestrel.server.tool_parsers.openai import OpenAIToolParser
from kestrel.server.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from kestrel.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser, Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    Glm45ToolParser,
    GraniteToolParser,
    HermesToolParser,
    KimiK2ToolParser,
    Llama3JsonToolParser,
    Llama4PythonicToolParser,
    MiniMaxM2ToolParser,
    MistralToolParser,
    OpenAIToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    Qwen3XmlToolParser,
)}

__all__ = ["Region", "ToolCall", "ToolCallStream", "ToolParser", "new_call_id", "TOOL_PARSERS", "get_tool_parser"]


def get_tool_parser(name: str | None) -> ToolParser | None:
    return lookup(TOOL_PARSERS, name, "tool-call parser")

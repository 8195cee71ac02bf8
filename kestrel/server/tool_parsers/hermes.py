"""hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, content around them (Hermes 2/3,
Qwen2.5, Qwen3)."""
from kestrel.server.tool_parsers.base import BlockToolParser, json_object_region


class HermesToolParser(BlockToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call(self, body, complete):
        return json_object_region(body, complete)

"""kimi_k2: Kimi K2's calls in a section after the content; the model names each call, and that id is the call's
id (Kimi's template reads it back):

  <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}
  <|tool_call_end|><|tool_calls_section_end|>"""
from kestrel.server.tool_parsers.base import SectionToolParser, raw_json_region

ARGS = "<|tool_call_argument_begin|>"


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    TAGS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
            "<|tool_call_begin|>", "<|tool_call_end|>")

    def section_open(self, text):
        singular = "<|tool_call_section_begin|>"  # a spelling some of its checkpoints write
        return singular if singular in text else self.TAGS[0]

    def call(self, body, complete):
        call_id, sep, args = body.partition(ARGS)
        if not sep:
            return raw_json_region(None, None, complete)
        call_id = call_id.strip()
        name = call_id.split(":")[0]
        name = name[len("functions."):] if name.startswith("functions.") else name
        return raw_json_region(name, args, complete, call_id=call_id)

"""minimax_m2: MiniMax-M2's calls, content before them:

  <minimax:tool_call>
  <invoke name="get_weather">
  <parameter name="city">Paris</parameter>
  </invoke>
  </minimax:tool_call>

Values are read by the tools' schema types (untyped ones as JSON where they are JSON)."""
from kestrel.server.tool_parsers.base import SectionToolParser, params_region
from kestrel.server.tool_parsers.qwen3_coder import tag_params


class MiniMaxM2ToolParser(SectionToolParser):
    name = "minimax_m2"
    TAGS = ("<minimax:tool_call>", "</minimax:tool_call>",
            "<invoke name=", "</invoke>")

    def call(self, body, complete):
        name, gt, rest = body.partition(">")
        if not gt:
            return params_region(None, [], complete, self.tools)
        return params_region(name.strip().strip("'\""), tag_params(rest, "<parameter name=", "</parameter>", complete),
                             complete, self.tools, untyped="json")

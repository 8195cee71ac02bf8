"""deepseek_v3 and deepseek_v31: DeepSeek's calls in a section after the content.

  deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                ```json
                {"city": "Paris"}
                ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>        (V3, R1-0528)
  deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
                <｜tool▁calls▁end｜>                              (V3.1, V3.2-Exp)"""
from kestrel.server.markers import between, visible
from kestrel.server.tool_parsers.base import SectionToolParser, raw_json_region

SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(SectionToolParser):
    name = "deepseek_v3"
    TAGS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")

    def call(self, body, complete):
        _, sep, rest = body.partition(SEP)
        name, newline, rest = rest.partition("\n")
        if not sep or not (newline or complete):
            return raw_json_region(None, None, complete)
        args, _, _ = between(rest, "```json", "```", complete)
        return raw_json_region(name.strip(), args, complete)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"

    def call(self, body, complete):
        name, sep, args = body.partition(SEP)
        if not sep:
            return raw_json_region(name.strip() if complete else None, None, complete)
        return raw_json_region(name.strip(), visible(args, complete, self.TAGS[3]), complete)

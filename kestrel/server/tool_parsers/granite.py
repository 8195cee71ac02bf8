"""granite: IBM Granite 3.x's JSON list of calls at the start of the output, after <|tool_call|> (3.0) or
<tool_call> (3.1 on), or bare:

  <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]"""
from kestrel.server.tool_parsers.base import ToolParser, json_sequence

TAGS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    name = "granite"
    keeps_special_tokens = True

    def scan(self, text, final):
        body = text.lstrip()
        for tag in TAGS:
            if body.startswith(tag):
                body = body[len(tag):].lstrip()
                break
            if tag.startswith(body) and not final:
                return [], [], True  # may still become the tag
        if not body and not final:
            return [], [], True
        if not body.startswith("["):
            return [(0, len(text))], [], False
        regions = json_sequence(body[1:], final, " \t\r\n,")
        return [], regions, not final and not any(r.name for r in regions)

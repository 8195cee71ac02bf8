"""openai: gpt-oss's harmony messages (server/harmony.py): a message to=functions.NAME is a call (its body the
arguments), final and commentary messages without a recipient are content, analysis is left to the reasoning
parser (openai_gptoss) or dropped, as are messages to built-in tools."""
from kestrel.server.harmony import pieces
from kestrel.server.tool_parsers.base import ToolParser, raw_json_region


class OpenAIToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True
    framed = True

    def scan(self, text, final):
        spans, regions = [], []
        for p in pieces(text, final):
            if p.recipient is not None:
                if p.recipient.startswith("functions."):
                    region = raw_json_region(p.recipient[len("functions."):], text[p.body[0]:p.body[1]], p.complete)
                    region.valid = True  # the model's arguments text as it wrote it, as vLLM passes it on
                    regions.append(region)
            elif p.channel != "analysis":
                spans.append(p.body)
        return spans, regions, False

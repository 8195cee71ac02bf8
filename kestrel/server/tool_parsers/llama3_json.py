"""llama3_json: {"name": ..., "parameters": {...}} objects separated by ';', optionally after <|python_tag|> (Llama
3.1/3.2/3.3 JSON tool calling); output that does not start with one is plain content."""
from kestrel.server.tool_parsers.base import ToolParser, json_sequence


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
        regions = json_sequence(body, final, " \t\r\n;")
        if final and not all(r.valid and r.name for r in regions):
            return [(0, len(text))], [], False  # JSON that is not calls: plain content
        undecided = not final and not any(r.name for r in regions)
        return [], regions, undecided

"""openai_gptoss: gpt-oss's harmony messages (server/harmony.py): analysis bodies are the reasoning; final and
preamble bodies the content; calls (messages with a recipient) stay in the content whole, for the openai tool
parser."""
from kestrel.server.harmony import pieces
from kestrel.server.reasoning.base import SnapshotReasoningParser


class GptOssReasoningParser(SnapshotReasoningParser):
    keeps_special_tokens = True
    framed = True

    def split(self, text, final):
        reasoning, content, saw = [], [], False
        for p in pieces(text, final):
            if p.recipient is not None:
                content.append(text[p.start:p.end])
            elif p.channel == "analysis":
                reasoning.append(text[p.body[0]:p.body[1]])
                saw = True
            else:
                content.append(text[p.body[0]:p.body[1]])
        return "".join(reasoning), "".join(content), saw

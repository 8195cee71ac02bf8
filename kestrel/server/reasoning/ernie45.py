"""ernie45: ERNIE-4.5 thinking: reasoning from the start up to </think>; the answer may sit in <response>...
</response>, whose tags leave the content."""
from kestrel.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


class Ernie45ReasoningParser(DeepSeekR1ReasoningParser):
    content_drops = ("<response>\n", "\n</response>", "<response>", "</response>")

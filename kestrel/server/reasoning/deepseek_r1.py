"""deepseek_r1: reasoning from the start up to </think> (the chat template opens <think>; the tag may repeat)."""
from kestrel.server.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True

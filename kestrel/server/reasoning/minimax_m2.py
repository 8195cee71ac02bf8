"""minimax_m2: MiniMax-M2: reasoning from the start (the template opens <think>) up to </think>."""
from kestrel.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


class MiniMaxM2ReasoningParser(DeepSeekR1ReasoningParser):
    pass

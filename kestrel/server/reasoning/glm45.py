"""glm45: GLM-4.5/4.6's <think>...</think> (as qwen3 reads it)."""
from kestrel.server.reasoning.qwen3 import Qwen3ReasoningParser


class Glm45ReasoningParser(Qwen3ReasoningParser):
    pass

"""qwen3: reasoning only inside <think>...</think> (no tags: all content; a closing tag alone: what came before)."""
from kestrel.server.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    pass

"""mistral: Magistral's [THINK]...[/THINK] (no tags: all content)."""
from kestrel.server.reasoning.base import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    starts, ends = ("[THINK]",), ("[/THINK]",)
    keeps_special_tokens = True

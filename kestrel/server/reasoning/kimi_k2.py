"""kimi_k2: Kimi K2 Thinking: reasoning from the start (an opening <think> is dropped) up to </think>, or up to a
tool-call section, which stays in the content for the kimi_k2 tool parser; chat_template_kwargs
{"thinking": false}: all content."""
from kestrel.server.reasoning.base import ReasoningParser


class KimiK2ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
    ends_kept = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    keeps_special_tokens = True

    def for_request(self, chat_template_kwargs):
        return self if (chat_template_kwargs or {}).get("thinking", True) else None

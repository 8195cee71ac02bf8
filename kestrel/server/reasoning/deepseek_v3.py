"""deepseek_v3: DeepSeek V3.1/V3.2, hybrid: with chat_template_kwargs {"thinking": true} the output is read as
deepseek_r1 reads it, else it is all content."""
from kestrel.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    def for_request(self, chat_template_kwargs):
        kwargs = chat_template_kwargs or {}
        return self if kwargs.get("thinking", kwargs.get("enable_thinking", False)) else None

"""hunyuan_a13b: Hunyuan-A13B's <think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>: the answer's tags leave the
content."""
from kestrel.server.reasoning.base import ReasoningParser


class HunyuanA13BReasoningParser(ReasoningParser):
    starts, ends = ("<think>\n",), ("\n</think>\n",)
    content_drops = ("<answer>\n", "\n</answer>")

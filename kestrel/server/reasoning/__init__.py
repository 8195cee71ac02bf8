"""Reasoning parsers (--reasoning-parser), by vLLM's names: one file each, registered here."""
from __future__ import annotations

from kestrel.server.markers import lookup
from kestrel.server.reasoning.base import ReasoningParser
from kestrel.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kestrel.server.reasoning.deepseek_v3 import DeepSeekV3ReasoningParser
from kestrel.server.reasoning.ernie45 import Ernie45ReasoningParser
from kestrel.server.reasoning.glm45 import Glm45ReasoningParser
from kestrel.server.reasoning.granite import GraniteReasoningParser
from kestrel.server.reasoning.hunyuan_a13b import HunyuanA13BReasoningParser
from kestrel.server.reasoning.kimi_k2 import KimiK2ReasoningParser
from kestrel.server.reasoning.minimax_m2 import MiniMaxM2ReasoningParser
from kestrel.server.reasoning.mistral import MistralReasoningParser
from kestrel.server.reasoning.openai_gptoss import GptOssReasoningParser
from kestrel.server.reasoning.qwen3 import Qwen3ReasoningParser
from kestrel.server.reasoning.seed_oss import SeedOssReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "deepseek_v3": DeepSeekV3ReasoningParser,
    "ernie45": Ernie45ReasoningParser,
    "glm45": Glm45ReasoningParser,
    "granite": GraniteReasoningParser,
    "hunyuan_a13b": HunyuanA13BReasoningParser,
    "kimi_k2": KimiK2ReasoningParser,
    "minimax_m2": MiniMaxM2ReasoningParser,
    "mistral": MistralReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "seed_oss": SeedOssReasoningParser,
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    return lookup(REASONING_PARSERS, name, "reasoning parser")

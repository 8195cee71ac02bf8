"""Architecture name (config.json `architectures[0]`) -> model class."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("kestrel.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kestrel.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("kestrel.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kestrel.models.qwen", "Qwen3ForCausalLM"),
    "GemmaForCausalLM": ("kestrel.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("kestrel.models.gemma3", "Gemma3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("kestrel.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("kestrel.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("kestrel.models.mixtral", "MixtralForCausalLM"),
    "Glm4MoeForCausalLM": ("kestrel.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("kestrel.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("kestrel.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("kestrel.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("kestrel.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    "PaliGemmaForConditionalGeneration": ("kestrel.models.paligemma", "PaliGemmaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("kestrel.models.llava_next", "LlavaNextForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)

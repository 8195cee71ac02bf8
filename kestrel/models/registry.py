"""Architecture name (config.json `architectures[0]`) -> model class."""
from __future__ import annotations

import importlib

from kestrel.core.pooling import CLASSIFY_ARCH_SUFFIX, base_architecture
from kestrel.models.pooling import classifier_class

_MODELS = {
    "LlamaForCausalLM": ("kestrel.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kestrel.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("kestrel.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kestrel.models.qwen", "Qwen3ForCausalLM"),
    # Llama with options its attention reads from the config: q/k/v bias without an o bias (Seed-OSS), NoPE layers
    # (SmolLM3), llama-4 query scaling on top of yarn (Ministral 3)
    "SeedOssForCausalLM": ("kestrel.models.llama", "LlamaForCausalLM"),
    "SmolLM3ForCausalLM": ("kestrel.models.llama", "LlamaForCausalLM"),
    "Ministral3ForCausalLM": ("kestrel.models.llama", "LlamaForCausalLM"),
    "Olmo2ForCausalLM": ("kestrel.models.olmo", "Olmo3ForCausalLM"),
    "Olmo3ForCausalLM": ("kestrel.models.olmo", "Olmo3ForCausalLM"),
    "GemmaForCausalLM": ("kestrel.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("kestrel.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("kestrel.models.gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("kestrel.models.gemma4", "Gemma4ForConditionalGeneration"),
    "Qwen2MoeForCausalLM": ("kestrel.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("kestrel.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("kestrel.models.mixtral", "MixtralForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("kestrel.models.ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("kestrel.models.hunyuan", "HunYuanMoEV1ForCausalLM"),
    "MiniMaxM2ForCausalLM": ("kestrel.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "GptOssForCausalLM": ("kestrel.models.gpt_oss", "GptOssForCausalLM"),
    "Llama4ForCausalLM": ("kestrel.models.llama4", "Llama4ForCausalLM"),
    "Glm4ForCausalLM": ("kestrel.models.glm4", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("kestrel.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("kestrel.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("kestrel.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "Mistral4ForCausalLM": ("kestrel.models.deepseek_v2", "Mistral4ForCausalLM"),
    # Kimi K2.5 / K2.6: the text part (DeepSeek-V3, INT4 experts); the vision tower refused
    "KimiK25ForConditionalGeneration": ("kestrel.models.kimi_k25", "KimiK25ForConditionalGeneration"),
    "Kimi_K25ForConditionalGeneration": ("kestrel.models.kimi_k25", "KimiK25ForConditionalGeneration"),
    "KimiLinearForCausalLM": ("kestrel.models.kimi_linear", "KimiLinearForCausalLM"),
    "Qwen3NextForCausalLM": ("kestrel.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("kestrel.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("kestrel.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("kestrel.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("kestrel.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "DeepseekV32ForCausalLM": ("kestrel.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("kestrel.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    "PaliGemmaForConditionalGeneration": ("kestrel.models.paligemma", "PaliGemmaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("kestrel.models.llava_next", "LlavaNextForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("kestrel.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("kestrel.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("kestrel.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Glm4vMoeForConditionalGeneration": ("kestrel.models.glm4v_moe", "Glm4vMoeForConditionalGeneration"),
    "Glm4vForConditionalGeneration": ("kestrel.models.glm4v", "Glm4vForConditionalGeneration"),
    "Glm46VForConditionalGeneration": ("kestrel.models.glm4v", "Glm46VForConditionalGeneration"),
    # encoder-only embedding models (pooling only)
    "BertModel": ("kestrel.models.bert", "BertModel"),
    "XLMRobertaModel": ("kestrel.models.bert", "XLMRobertaModel"),
    "RobertaModel": ("kestrel.models.bert", "XLMRobertaModel"),
    "BertForSequenceClassification": ("kestrel.models.bert_classifier", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("kestrel.models.bert_classifier", "XLMRobertaForSequenceClassification"),
    "RobertaForSequenceClassification": ("kestrel.models.bert_classifier", "XLMRobertaForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in _MODELS or base_architecture(architecture) in _MODELS


def get_model_class(architecture: str):
    """A pooling checkpoint (Qwen3ForSequenceClassification, Qwen3Model) gets its decoder's class, with the
    classifier head where it has one (kestrel/models/pooling.py)."""
    base = base_architecture(architecture)
    if base != architecture and base in _MODELS:
        decoder = get_model_class(base)
        return classifier_class(decoder) if architecture.endswith(CLASSIFY_ARCH_SUFFIX) else decoder
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)

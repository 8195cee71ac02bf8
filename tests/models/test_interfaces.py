"""Every registered model class declares its capabilities (kestrel/models/interfaces.py) consistently: a class
that takes images implements the whole image interface, a bidirectional prefix belongs to an image model (the
processor's token types give its length) or is an encoder's whole prompt (EncoderOnly), and LoRA stages beyond the
decoder come with their row counts, and a declared position scheme is implemented."""
from __future__ import annotations

import pytest

from kestrel.models.interfaces import (HasBidirectionalPrefix, HasPositionScheme, SupportsImages, SupportsLoRA,
                                       has_bidirectional_prefix, is_encoder_only, supports_images, supports_lora)
from kestrel.models.registry import get_model_class, supported_architectures

IMAGE_METHODS = ("split_images", "num_image_tokens", "embed_image", "dummy_image_inputs")
STAGES = {"decoder", "tower", "connector"}


def _overrides(cls, base, name) -> bool:
    return getattr(cls, name) is not getattr(base, name)


def capability_problems(cls) -> list[str]:
    problems = []
    if supports_images(cls):
        problems += [f"declares SupportsImages but does not implement {m}" for m in IMAGE_METHODS
                     if not _overrides(cls, SupportsImages, m)]
    elif any(hasattr(cls, m) for m in IMAGE_METHODS):
        problems.append("has image methods but does not declare SupportsImages")
    if has_bidirectional_prefix(cls) and not supports_images(cls) and not is_encoder_only(cls):
        problems.append("declares HasBidirectionalPrefix without SupportsImages (the prefix is image + prompt) or "
                        "EncoderOnly (the prompt)")
    if (issubclass(cls, HasPositionScheme)  # a classmethod: compare the functions bound
            and cls.position_scheme.__func__ is HasPositionScheme.position_scheme.__func__):
        problems.append("declares HasPositionScheme but does not implement position_scheme")
    if supports_lora(cls):
        stages = {stage for _, stage in cls.lora_stages}
        if not stages <= STAGES or "decoder" not in stages:
            problems.append(f"lora_stages {sorted(stages)}: must include 'decoder', within {sorted(STAGES)}")
        if stages - {"decoder"} and not _overrides(cls, SupportsLoRA, "lora_encoder_tokens"):
            problems.append("LoRA on vision parts without lora_encoder_tokens")
    return problems


@pytest.mark.parametrize("arch", supported_architectures())
def test_registered_model_declares_consistently(arch):
    cls = get_model_class(arch)
    assert capability_problems(cls) == []
    # every registered decoder family's Linears take adapters (LoRA on encoders is not implemented)
    assert supports_lora(cls) != is_encoder_only(cls)
    assert isinstance(cls.packed_modules, dict)


def test_image_models_are_declared():
    declared = {a for a in supported_architectures() if supports_images(get_model_class(a))}
    qwen_vl = {"Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
               "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
               "Qwen3_5MoeForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
               "Glm4vForConditionalGeneration", "Glm46VForConditionalGeneration"}
    assert declared == {"PaliGemmaForConditionalGeneration", "LlavaNextForConditionalGeneration"} | qwen_vl
    schemes = {a for a in supported_architectures() if issubclass(get_model_class(a), HasPositionScheme)}
    assert schemes == qwen_vl
    prefixed = [a for a in declared if has_bidirectional_prefix(get_model_class(a))]
    assert prefixed == ["PaliGemmaForConditionalGeneration"]


def test_the_check_catches_an_inconsistent_declaration():
    class HalfImages(SupportsImages):
        def embed_image(self, image):
            return image

    class PrefixWithoutImages(HasBidirectionalPrefix):
        pass

    class TowerLoRA(SupportsLoRA):
        lora_stages = (("language_model.", "decoder"), ("vision_tower.", "tower"))

    class Undeclared:
        def embed_image(self, image):
            return image

    class NoScheme(HasPositionScheme):
        pass

    assert capability_problems(HalfImages) == [f"declares SupportsImages but does not implement {m}"
                                               for m in ("split_images", "num_image_tokens", "dummy_image_inputs")]
    assert capability_problems(PrefixWithoutImages) == [
        "declares HasBidirectionalPrefix without SupportsImages (the prefix is image + prompt) or EncoderOnly (the "
        "prompt)"]
    assert capability_problems(TowerLoRA) == ["LoRA on vision parts without lora_encoder_tokens"]
    assert capability_problems(Undeclared) == ["has image methods but does not declare SupportsImages"]
    assert capability_problems(NoScheme) == ["declares HasPositionScheme but does not implement position_scheme"]
    assert supports_images(HalfImages()) and not supports_lora(Undeclared())  # instances answer too

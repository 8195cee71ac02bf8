"""What a model class can do beyond the text interface (embed_input_ids, forward, compute_logits, load_weights),
declared by inheriting these bases rather than found by probing for attributes. The frontend, the runner's
add-ons and the LoRA manager ask `issubclass`/`isinstance` (the helpers below); tests/models/test_interfaces.py
checks that every registered class declares consistently.

- `SupportsLoRA`: its Linears take adapters. `lora_stages` (module prefix -> "decoder", "tower" or "connector")
  says which parts; `lora_module_name(path)` maps an adapter's module paths to ours (None: a module we do not
  build); a model whose tower or connector takes adapters gives `lora_encoder_tokens(image)`, the rows each part
  processes for one image, counted from its processed inputs. `packed_modules` (our merged module -> the
  checkpoint's modules it stacks) serves the weight loader and the adapter loader alike.
- `SupportsImages`: it takes images (frontend: `split_images`, `num_image_tokens`; runner: `embed_image`,
  `dummy_image_inputs`); see kestrel/models/multimodal.py.
- `HasBidirectionalPrefix`: a request's prefix (image + prompt, RequestExtras.bidirectional_len) attends both
  ways (PaliGemma). Its attention backend must declare `supports_bidirectional_prefix`.
- `HasPositionScheme`: its positions are not the token index (M-RoPE): `position_scheme(hf_config)` says how the
  frontend computes a prompt's and how many rows the runner stages per token (kestrel/core/positions.py); every
  other model gets ONE_D.
- `EncoderOnly`: a bidirectional encoder (BERT, XLM-R) served as a pooling model: the whole prompt is its
  bidirectional prefix (the frontend sets it), so the scheduler computes it in one step; it has no prefix caching
  (the pooler reads every prompt token's hidden state); `default_pooling` is its pooling without a
  sentence-transformers config (kestrel/core/pooling.py)."""
from __future__ import annotations

from typing import ClassVar

import torch

from kestrel.core.positions import ONE_D, PositionScheme


class SupportsLoRA:
    lora_stages: ClassVar[tuple[tuple[str, str], ...]] = (("", "decoder"),)  # a text model: all decoder
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {}

    def lora_module_name(self, path: str) -> str | None:
        """Our module path for an adapter's (a text model's checkpoint names are ours)."""
        return path

    def lora_encoder_tokens(self, image: dict[str, torch.Tensor]) -> dict[str, int]:
        """Per non-decoder stage of `lora_stages`, the rows it processes for one image."""
        raise NotImplementedError(f"{type(self).__name__} declares LoRA stages beyond the decoder but no row counts")


class SupportsImages:
    @staticmethod
    def split_images(hf_config, processed) -> list[dict[str, torch.Tensor]]:
        """The HF processor's batch output cut into each image's encoder inputs."""
        raise NotImplementedError

    @staticmethod
    def num_image_tokens(hf_config, image: dict[str, torch.Tensor]) -> int:
        """How many embeddings one image becomes, computed forward from its processed inputs."""
        raise NotImplementedError

    def embed_image(self, image: dict[str, torch.Tensor]) -> torch.Tensor:
        """[num_image_tokens, hidden]: the rows that replace the image's placeholders in forward(inputs_embeds)."""
        raise NotImplementedError

    def dummy_image_inputs(self) -> dict[str, torch.Tensor]:
        """Encoder inputs of the largest image the model takes (start-up memory profile and warm-up)."""
        raise NotImplementedError


class HasBidirectionalPrefix:
    pass


class HasPositionScheme:
    @classmethod
    def position_scheme(cls, hf_config) -> PositionScheme:
        raise NotImplementedError


class EncoderOnly(HasBidirectionalPrefix):
    default_pooling: ClassVar[str] = "cls"


def supports_lora(model) -> bool:
    """`model`: a model class or instance."""
    return _is(model, SupportsLoRA)


def supports_images(model) -> bool:
    return _is(model, SupportsImages)


def has_bidirectional_prefix(model) -> bool:
    return _is(model, HasBidirectionalPrefix)


def position_scheme(model, hf_config) -> PositionScheme:
    """The model's position scheme (`model`: a class or an instance)."""
    cls = model if isinstance(model, type) else type(model)
    return cls.position_scheme(hf_config) if _is(cls, HasPositionScheme) else ONE_D


def is_encoder_only(model) -> bool:
    return _is(model, EncoderOnly)


def _is(model, interface: type) -> bool:
    return issubclass(model if isinstance(model, type) else type(model), interface)

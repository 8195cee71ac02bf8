"""The checkpoint's config.json as the engine reads it: one typed view instead of `getattr` on the raw HF config
in several places. Multimodal checkpoints nest the decoder's settings in `text_config`; `text` is that config
(the config itself for text-only models), and everything the engine needs is read from it once, here."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048  # a config without max_position_embeddings
ROBERTA_TYPES = ("roberta", "xlm-roberta")


@dataclass
class HFConfig:
    hf: Any  # transformers PretrainedConfig, as loaded
    text: Any  # the decoder's config
    architecture: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    eos_token_ids: list[int]
    # a pooling model's (kestrel/models/pooling.py resolve_pooling sets them from the class and the checkpoint)
    encoder_only: bool = False  # a bidirectional encoder (BERT): each prompt is computed whole, no prefix caching
    pooling_method: str = "last"  # which hidden states an embedding pools: last | cls | mean

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf(cls, hf: Any, requested_max_len: int | None = None) -> "HFConfig":
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        arch = (getattr(hf, "architectures", None) or ["LlamaForCausalLM"])[0]
        native = getattr(text, "max_position_embeddings", None) or DEFAULT_CONTEXT
        if getattr(text, "model_type", "") in ROBERTA_TYPES:  # its positions start after the padding id
            native -= (getattr(text, "pad_token_id", None) or 0) + 1
        if requested_max_len is not None and requested_max_len > native:
            logger.warning("max_model_len %d exceeds the model's %d positions", requested_max_len, native)
        eos = getattr(hf, "eos_token_id", None)
        if eos is None:
            eos = getattr(text, "eos_token_id", None)
        eos_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        return cls(hf, text, arch, requested_max_len or native, text.vocab_size, text.hidden_size, eos_ids)

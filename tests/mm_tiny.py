"""Tiny random PaliGemma and LLaVA-NeXT checkpoints with real processors (image processor + tokenizer + chat
template) saved as HF folders, built from transformers configs only (no hub)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kestrel.bench.tiny_tokenizer import IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE, make_tokenizer, tokenizer_with_image_token

# pinpoints (height, width) in units of the 28-pixel tile: 1x2, 2x1, 2x2, 1x3
PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84]]


def _randomize(model, seed: int, norm_offset: float) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():  # larger weights than the default init: peakier logits, fewer near-ties
        for name, p in model.named_parameters():
            if ("language_model" in name and "self_attn" in name) or "multi_modal_projector" in name:
                p.normal_(0, 0.3)  # sharp, loud attention: the outputs depend on the image
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name and "language_model" in name:  # Gemma norms scale by 1 + weight, Llama's by weight
                p.normal_(norm_offset, 0.2)
            else:
                p.normal_(0, 0.05)


def make_paligemma(root: Path, seed: int = 0, name: str = "paligemma", vision_use_head: bool = False) -> Path:
    """vision_use_head=True: SigLIP's attention-pooling head is built and saved too (transformers' default flag),
    though PaliGemma never runs it."""
    from transformers import (GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor,
                              SiglipVisionConfig)
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    image_proc = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    image_proc.image_seq_length = 16
    processor = PaliGemmaProcessor(image_processor=image_proc, tokenizer=make_tokenizer())
    tok = processor.tokenizer
    vocab = len(tok)
    text = GemmaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh",
                       max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=28, patch_size=7, vision_use_head=vision_use_head)
    cfg = PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=64,
                          hidden_size=64, image_token_index=processor.image_token_id, vocab_size=vocab)
    cfg.text_config.vocab_size = vocab
    model = PaliGemmaForConditionalGeneration(cfg)
    _randomize(model, seed, norm_offset=0.0)
    out = root / name
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def make_llava_next(root: Path, seed: int = 0, name: str = "llava_next", decoder: str = "llama",
                    **text_overrides) -> Path:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration
    from transformers import Qwen2Config
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = tokenizer_with_image_token()
    image_proc = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                            image_grid_pinpoints=PINPOINTS)
    processor = LlavaNextProcessor(image_processor=image_proc, tokenizer=tok, patch_size=7,
                                   vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                                   num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE)
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    vocab = len(tok)
    text_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[decoder]
    # overrides go to the constructor: attributes derived there (head_dim = hidden_size // heads) must follow them
    text = text_cls(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id), **text_overrides})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=28, patch_size=7, projection_dim=32)
    cfg = LlavaNextConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_grid_pinpoints=PINPOINTS,
                          vision_feature_layer=-2, vision_feature_select_strategy="default",
                          image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=False)
    model = LlavaNextForConditionalGeneration(cfg)
    _randomize(model, seed, norm_offset=1.0)
    out = root / name
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def make_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# three images of different sizes and aspect ratios (wide, tall, square-ish)
IMAGE_SIZES = [(90, 40), (33, 70), (64, 60)]


def sample_images():
    return [make_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SIZES)]

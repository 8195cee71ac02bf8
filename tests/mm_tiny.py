"""Tiny random PaliGemma and LLaVA-NeXT checkpoints with real processors (image processor + tokenizer + chat
template) saved as HF folders, built from transformers configs only (no hub)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kestrel.bench.tiny_tokenizer import (IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE, QWEN_VL_CHAT_TEMPLATE, QWEN_VL_TOKENS,
                                         make_tokenizer, tokenizer_with_image_token)

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




def make_qwen2_5_vl(root: Path, seed: int = 0, name: str = "qwen2_5_vl", **text_overrides) -> Path:
    """Tiny Qwen2.5-VL: a 4-block ViT (blocks 1 and 3 full attention, the others in windows of 2x2 merged tokens),
    the 2x2 merger, a 2-layer decoder with sectioned M-RoPE. The processor's parts are saved one by one (its video
    processor needs torchvision, which the CPU image may lack); qwen_vl_processor() rebuilds transformers' own
    processor over them for image prompts. `text_overrides` go to the decoder's config (hidden_size 256 with
    mrope_section [8, 12, 12]: head dim 64, the Triton kernels' smallest)."""
    vision = dict(depth=4, fullatt_block_indexes=[1, 3], hidden_size=32, intermediate_size=48, num_heads=4,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, hidden_act="silu")
    return _make_qwen_vl(root, "qwen2_5_vl", seed, name, vision, text_overrides)


def make_qwen3_vl(root: Path, seed: int = 0, name: str = "qwen3_vl", **text_overrides) -> Path:
    """Tiny Qwen3-VL: a 4-block ViT (16-pixel patches, a 6x6 learned position grid, DeepStack from blocks 1 and 2)
    and a 2-layer Qwen3 decoder with interleaved M-RoPE."""
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=36, deepstack_visual_indexes=[1, 2],
                  hidden_act="gelu_pytorch_tanh")
    return _make_qwen_vl(root, "qwen3_vl", seed, name, vision, {"head_dim": 16, **text_overrides})


def make_qwen3_vl_moe(root: Path, seed: int = 0, name: str = "qwen3_vl_moe", **text_overrides) -> Path:
    """Tiny Qwen3-VL-MoE: make_qwen3_vl's tower and a 2-layer Qwen3-MoE decoder (4 experts, top 2; 2 x
    moe_intermediate_size != hidden_size, so the stacked experts' layout is told by shape)."""
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=36, deepstack_visual_indexes=[1, 2],
                  hidden_act="gelu_pytorch_tanh")
    text = {"head_dim": 16, "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, **text_overrides}
    return _make_qwen_vl(root, "qwen3_vl_moe", seed, name, vision, text)


def make_qwen3_5_vl(root: Path, seed: int = 0, name: str = "qwen3_5_vl", moe: bool = False,
                     **text_overrides) -> Path:
    """Tiny Qwen3.5 (or, `moe`, Qwen3.5-MoE) with its vision tower: make_qwen3_vl's tower without DeepStack and the
    Gated DeltaNet hybrid of tests/tiny.py (layers 0-2 GDN, layer 3 gated attention with partial RoPE 0.25 on heads
    of 32: 4 rotary frequencies, interleaved M-RoPE rows t, h, w, t)."""
    from tests.tiny import _GDN, _GDN_MOE

    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=36, hidden_act="gelu_pytorch_tanh")
    text = {**_GDN, **(_GDN_MOE if moe else {}), "mrope_interleaved": True, "partial_rotary_factor": 0.25,
            **text_overrides}
    return _make_qwen_vl(root, "qwen3_5_moe" if moe else "qwen3_5", seed, name, vision, text)


def _image_sensitive_weights(model, seed: int, loud: tuple[str, ...]) -> None:
    """Random weights whose outputs depend on the images: parameters named by `loud` (attention, the merger) at
    std 0.3 (sharp attention, loud image rows), other matrices 0.08, norms around 1."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if any(part in pname for part in loud):
                p.normal_(0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in pname:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.05)


def _make_qwen_vl(root: Path, kind: str, seed: int, name: str, vision: dict, text_overrides: dict) -> Path:
    from tokenizers import AddedToken
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                              Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                              Qwen3VLMoeForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config_cls, model_cls = {"qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
                             "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
                             "qwen3_vl_moe": (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration),
                             "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
                             "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)}[kind]
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                          for t in QWEN_VL_TOKENS]})
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    patch = vision["patch_size"]
    image_proc = Qwen2VLImageProcessorPil(min_pixels=(2 * patch) ** 2 * 4, max_pixels=(2 * patch) ** 2 * 30,
                                          patch_size=patch, temporal_patch_size=2, merge_size=2)
    vocab = len(tok)
    section = text_overrides.pop("mrope_section", [2, 3, 3])
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    rope.update({k: text_overrides.pop(k) for k in ("mrope_interleaved", "partial_rotary_factor")
                 if k in text_overrides})
    text = {**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rope_parameters=rope),
            **text_overrides}
    vision = {**vision, "out_hidden_size": text["hidden_size"]}
    cfg = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                     video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = model_cls(cfg)
    _image_sensitive_weights(model, seed, ("self_attn", "merger"))
    out = root / name
    model.save_pretrained(out)
    tok.save_pretrained(out)
    image_proc.save_pretrained(out)
    # the video processor's settings (transformers' Qwen2VL/Qwen3VLVideoProcessor read them): small frames
    video_type = "Qwen2VLVideoProcessor" if kind == "qwen2_5_vl" else "Qwen3VLVideoProcessor"
    unit = (2 * patch) ** 2
    video_cfg = {"video_processor_type": video_type, "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2,
                 "size": {"shortest_edge": unit * 4, "longest_edge": unit * (12 if kind == "qwen2_5_vl" else 24)}}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))
    return out


VIDEO_STYLES = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl", "qwen3_5": "qwen3_vl",
                "qwen3_5_moe": "qwen3_vl"}


def qwen_vl_processor(path: Path, video: bool = False):
    """transformers' own Qwen-VL processor (by the checkpoint's model type) over the checkpoint's tokenizer and
    image processor, without its video processor (torchvision): its text expansion and outputs for image prompts.
    `video`: with kestrel's video processor (kestrel/frontend/qwen_video.py) in its place, for transformers' text
    expansion of video prompts."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kind = json.loads((Path(path) / "config.json").read_text())["model_type"]
    cls = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor, "qwen3_vl_moe": Qwen3VLProcessor,
           "qwen3_5": Qwen3VLProcessor, "qwen3_5_moe": Qwen3VLProcessor}[kind]
    proc = cls.__new__(cls)
    tok = AutoTokenizer.from_pretrained(path)
    proc.tokenizer, proc.image_processor = tok, Qwen2VLImageProcessorPil.from_pretrained(path)
    proc.chat_template = None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = tok.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = tok.convert_tokens_to_ids(proc.video_token)
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    if video:  # kestrel's torchvision-free twin of the checkpoint's video processor
        from kestrel.frontend.qwen_video import QwenVideoProcessor

        proc.video_processor = QwenVideoProcessor.from_pretrained(str(path), VIDEO_STYLES[kind])
    return proc


GLM4V_TOKENS = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                "<|video|>"]


# GLM-4.xV checkpoint kinds (make_glm4v): transformers' config and model class, the text model's type where the
# layout names it, and whether that text model is the MoE one
GLM4V_KINDS = {"glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", None, True),
               "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration", "glm4v_moe_text", True),
               "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", None, False),
               "glm46v_dense": ("Glm46VConfig", "Glm46VForConditionalGeneration", "glm4v_text", False)}


def make_glm4v(root: Path, kind: str = "glm4v_moe", seed: int = 0, name: str | None = None) -> Path:
    """Tiny GLM-4.xV (`kind` of GLM4V_KINDS): a 2-block GLM-4.xV tower (14-pixel patches, a 6x6 learned position
    grid, qkv bias) and a 2-layer decoder with heads of 32, half of them rotating by sectioned M-RoPE [2, 3, 3]:
    GLM-4-MoE (GLM-4.5V; layer 0 dense, layer 1 MoE: 4 experts top-2 + a shared expert) or the dense GLM-4 one
    (GLM-4.1V: sandwich norms, pair rotary). `glm46v*`: transformers' `glm46v` layout (Glm46VForConditionalGeneration)
    with the same tower over that text model. Its image processor is saved alone (the video processor needs
    torchvision); glm4v_processor() rebuilds transformers' processor over it."""
    import transformers
    from tokenizers import AddedToken
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    config_name, model_name, text_type, moe = GLM4V_KINDS[kind]
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                          for t in GLM4V_TOKENS]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in GLM4V_TOKENS}
    image_proc = Glm4vImageProcessorPil(size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 30},
                                        patch_size=14, temporal_patch_size=2, merge_size=2)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "partial_rotary_factor": 0.5})
    if moe:
        text.update(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    first_k_dense_replace=1, attention_bias=True)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=14, image_size=84,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, attention_bias=True)
    if text_type:
        text, vision = {**text, "model_type": text_type}, {**vision, "model_type": "glm4v_vision"}
    cfg = getattr(transformers, config_name)(
        text_config=text, vision_config=vision, image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False)
    model = getattr(transformers, model_name)(cfg)
    _image_sensitive_weights(model, seed, ("self_attn", "merger", "downsample"))
    out = root / (name or kind)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    image_proc.save_pretrained(out)
    # the video processor's settings (transformers' Glm4v/Glm46VVideoProcessor read them): small frames
    video_cfg = {"video_processor_type": "Glm46VVideoProcessor" if text_type else "Glm4vVideoProcessor",
                 "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 2 * 30}, "patch_size": 14,
                 "temporal_patch_size": 2, "merge_size": 2, "fps": 2}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))
    return out


def glm4v_processor(path: Path, video: bool = False):
    """transformers' Glm4vProcessor (Glm46VProcessor for the `glm46v` layout) over the checkpoint's tokenizer and
    image processor, without its video processor (torchvision): its text expansion and outputs for image prompts.
    `video`: with kestrel's video processor (kestrel/frontend/glm_video.py) in its place, for transformers' text
    expansion of video prompts."""
    from transformers import AutoTokenizer, Glm4vProcessor, Glm46VProcessor
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    glm46v = json.loads((Path(path) / "config.json").read_text())["model_type"] == "glm46v"
    cls = Glm46VProcessor if glm46v else Glm4vProcessor
    proc = cls.__new__(cls)
    tok = AutoTokenizer.from_pretrained(path)
    proc.tokenizer, proc.image_processor = tok, Glm4vImageProcessorPil.from_pretrained(path)
    proc.chat_template = None
    proc.image_token, proc.video_token = "<|image|>", "<|video|>"
    proc.image_token_id, proc.video_token_id = (tok.convert_tokens_to_ids(t) for t in ("<|image|>", "<|video|>"))
    proc.video_start_id, proc.video_end_id = (tok.convert_tokens_to_ids(t)
                                              for t in ("<|begin_of_video|>", "<|end_of_video|>"))
    if video:
        from kestrel.frontend.glm_video import GlmVideoProcessor

        proc.video_processor = GlmVideoProcessor.from_pretrained(str(path), "glm46v" if glm46v else "glm4v")
    return proc

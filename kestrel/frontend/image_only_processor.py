"""A stand-in for a checkpoint's HF processor where transformers cannot build that processor for a missing optional
package: transformers 5's Qwen-VL processors always build a video processor, which imports torchvision, so without
torchvision `AutoProcessor` raises ImportError even for image prompts. This one does what those processors do:
the checkpoint's image processor (the class its preprocessor_config.json names; transformers falls back to its PIL
form without torchvision), then each image's placeholder token in the text repeated as many times as the image
has embeddings (the model class counts them forward from the processed inputs: `num_image_tokens`); videos, where
the model class names a `video_style`, through kestrel/frontend/qwen_video.py (transformers' Qwen-VL video
processors without torchvision), each video's placeholder token replaced by the text the model class writes for
it (`video_replacements`, as transformers' processor of that family); then the tokenizer. A model without a
video style refuses videos by name."""
from __future__ import annotations

import json
from pathlib import Path

from kestrel.errors import InvalidRequest


# the config's special tokens a model class's video_replacements may write (by name, without "_token_id")
TOKEN_NAMES = ("image", "video", "vision_start", "vision_end", "image_start", "image_end", "video_start", "video_end")


def video_processor_class(style: str) -> type:
    """The torchvision-free video processor of a model class's `video_style`."""
    if style.startswith("glm"):
        from kestrel.frontend.glm_video import GlmVideoProcessor
        return GlmVideoProcessor
    from kestrel.frontend.qwen_video import QwenVideoProcessor
    return QwenVideoProcessor


class ImageOnlyProcessor:
    def __init__(self, tokenizer, image_processor, image_token: str, count_tokens, why: str,
                 video_processor=None, expand_videos=None, video_token: str | None = None):
        """`count_tokens(processed)`: the embedding count of each image of a processed batch; `why`: the reason
        transformers' own processor was not built (in the video refusal); `expand_videos(processed)`: each video's
        placeholder text (None with no video processor)."""
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token, self.count_tokens, self.why = image_token, count_tokens, why
        self.video_processor, self.expand_videos, self.video_token = video_processor, expand_videos, video_token

    @classmethod
    def from_pretrained(cls, path: str, hf_config, model_cls, image_token_id: int, why: str,
                        trust_remote_code: bool = False, image_kwargs: dict | None = None) -> "ImageOnlyProcessor":
        import transformers
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        name = json.loads((Path(path) / "preprocessor_config.json").read_text())["image_processor_type"]
        image_processor = getattr(transformers, name).from_pretrained(path, **(image_kwargs or {}))

        def count(processed):
            return [model_cls.num_image_tokens(hf_config, im) for im in model_cls.split_images(hf_config, processed)]
        style = getattr(model_cls, "video_style", None)
        if style is None:
            return cls(tokenizer, image_processor, tokenizer.convert_ids_to_tokens(image_token_id), count, why)
        video = video_processor_class(style).from_pretrained(path, style, getattr(model_cls, "max_pixels", None),
                                                             **(image_kwargs or {}))
        names = {k: tokenizer.convert_ids_to_tokens(getattr(hf_config, f"{k}_token_id")) for k in TOKEN_NAMES
                 if getattr(hf_config, f"{k}_token_id", None) is not None}
        return cls(tokenizer, image_processor, tokenizer.convert_ids_to_tokens(image_token_id), count, why, video,
                   lambda processed: model_cls.video_replacements(hf_config, processed, names), names["video"])

    def __call__(self, text: list[str], images=None, videos=None, return_tensors: str = "pt",
                 add_special_tokens: bool = True, video_metadata=None, **kwargs):
        if videos is not None and self.video_processor is None:
            raise InvalidRequest(f"videos need the model's full processor, which is not available: {self.why}",
                                 param="multi_modal_data")
        (prompt,) = text
        out = {}
        if images:
            out = dict(self.image_processor(images=images[0], return_tensors=return_tensors))
            counts = self.count_tokens(out)
            pieces = prompt.split(self.image_token)
            if len(pieces) - 1 != len(counts):
                raise ValueError(f"the text has {len(pieces) - 1} image tokens for {len(counts)} images")
            prompt = pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:]))
        if videos:
            processed = self.video_processor(videos, video_metadata=video_metadata)
            texts = self.expand_videos(processed)
            pieces = prompt.split(self.video_token)
            if len(pieces) - 1 != len(texts):
                raise ValueError(f"the text has {len(pieces) - 1} video tokens for {len(texts)} videos")
            prompt = pieces[0] + "".join(t + rest for t, rest in zip(texts, pieces[1:]))
            out.update({k: v for k, v in processed.items() if k != "video_metadata"})
        out.update(self.tokenizer([prompt], add_special_tokens=add_special_tokens, return_tensors=return_tensors))
        return out

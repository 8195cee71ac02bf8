"""An image-only stand-in for a checkpoint's HF processor where transformers cannot build that processor for a
missing optional package: transformers 5's Qwen-VL processors always build a video processor, which imports
torchvision, so without torchvision `AutoProcessor` raises ImportError even for image prompts. This one does what
those processors do for images: the checkpoint's image processor (the class its preprocessor_config.json names;
transformers falls back to its PIL form without torchvision), then each image's placeholder token in the text
repeated as many times as the image has embeddings (the model class counts them forward from the processed
inputs: `num_image_tokens`), then the tokenizer. Videos are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

from kestrel.errors import InvalidRequest


class ImageOnlyProcessor:
    def __init__(self, tokenizer, image_processor, image_token: str, count_tokens, why: str):
        """`count_tokens(processed)`: the embedding count of each image of a processed batch; `why`: the reason
        transformers' own processor was not built (in the video refusal)."""
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token, self.count_tokens, self.why = image_token, count_tokens, why

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
        return cls(tokenizer, image_processor, tokenizer.convert_ids_to_tokens(image_token_id), count, why)

    def __call__(self, text: list[str], images=None, videos=None, return_tensors: str = "pt",
                 add_special_tokens: bool = True, **kwargs):
        if videos is not None:
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
        out.update(self.tokenizer([prompt], add_special_tokens=add_special_tokens, return_tensors=return_tensors))
        return out

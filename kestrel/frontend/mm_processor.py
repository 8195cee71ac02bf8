"""Image inputs in the frontend: the model's HF processor (image processor + prompt expansion) turns a prompt and
its images into token ids with placeholder runs and pixel tensors; each image becomes an `MMFeature` (its encoder
inputs, placeholder range and content hash) that travels to the engine core with the token ids.

Placeholder ranges are assigned from counts the model computes forward from each image's processed inputs
(`num_image_tokens`), in prompt order; the processor's placeholders must match them exactly.

The server runs `process` on several render threads at once (--renderer-num-workers): each thread works with its
own copy of the HF processor, whose tokenizer keeps per-call state (padding/truncation) that threads must not share."""
from __future__ import annotations

import copy
import logging
import threading

import numpy as np
import torch

from kestrel.core.extras import RequestExtras
from kestrel.core.multimodal import MMFeature, TensorData, hash_tensors
from kestrel.errors import InvalidRequest
from kestrel.models.interfaces import has_bidirectional_prefix
from kestrel.models.multimodal import image_token_id

logger = logging.getLogger(__name__)


def as_image_list(images, param: str = "multi_modal_data") -> list:
    from PIL import Image

    imgs = list(images) if isinstance(images, (list, tuple)) else [images]
    for i, im in enumerate(imgs):
        if not isinstance(im, Image.Image):
            raise InvalidRequest(f"image {i} is a {type(im).__name__}, not a PIL image", param=param)
    return [im if im.mode == "RGB" else im.convert("RGB") for im in imgs]


def as_video_list(videos, param: str = "multi_modal_data") -> list[tuple[object, dict | None]]:
    """vLLM's video forms -> [(frames, metadata or None)]: one video (a list of PIL frames, an array [T, H, W, 3],
    a list of [H, W, 3] frames, or a (frames, metadata dict) pair) or a list of videos."""
    from PIL import Image

    def one(v):
        if isinstance(v, tuple) and len(v) == 2 and (v[1] is None or isinstance(v[1], dict)):
            return v[0], v[1]
        return v, None

    def is_video(v) -> bool:
        v = one(v)[0]
        if isinstance(v, (list, tuple)):
            return bool(v) and all(isinstance(f, Image.Image) or getattr(f, "ndim", 0) == 3 for f in v)
        return getattr(v, "ndim", 0) == 4
    if is_video(videos):
        videos = [videos]
    if not isinstance(videos, (list, tuple)) or not all(is_video(v) for v in videos):
        raise InvalidRequest("a video is a list of PIL frames, an array [T, H, W, 3] or a (frames, metadata) pair",
                             param=param)
    out = []
    for v in videos:
        frames, meta = one(v)
        if isinstance(frames, (list, tuple)) and not isinstance(frames[0], Image.Image):
            frames = np.stack([np.asarray(f) for f in frames])
        out.append((frames, meta))
    return out


class MultiModalProcessor:
    def __init__(self, model_path: str, hf_config, model_cls, limit_per_prompt: int | dict[str, int],
                 trust_remote_code: bool = False, processor_kwargs: dict | None = None):
        """`limit_per_prompt`: the most images / videos in one prompt ({"image": N, "video": M}, or N for each).
        `processor_kwargs` (--mm-processor-kwargs) go to the HF processor's from_pretrained (Qwen-VL's
        min_pixels / max_pixels reach its image processor there)."""
        from transformers import AutoProcessor

        self.hf_config = hf_config
        self.model_cls = model_cls
        self.bidirectional_prefix = has_bidirectional_prefix(model_cls)  # the prefix length comes from token types
        self.limits = (dict(limit_per_prompt) if isinstance(limit_per_prompt, dict)
                       else {"image": limit_per_prompt, "video": limit_per_prompt})
        self.image_token_id = image_token_id(hf_config)
        try:
            self.processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                           **(processor_kwargs or {}))
        except ImportError as e:  # an optional package of a part images do not use (Qwen-VL's video processor)
            from kestrel.frontend.image_only_processor import ImageOnlyProcessor

            logger.warning("the checkpoint's processor needs a missing package (%s); serving images only, through "
                           "its image processor and tokenizer", str(e).strip().splitlines()[0])
            self.processor = ImageOnlyProcessor.from_pretrained(model_path, hf_config, model_cls, self.image_token_id,
                                                                str(e).strip().splitlines()[0], trust_remote_code,
                                                                processor_kwargs)
        self.image_token = self.processor.tokenizer.convert_ids_to_tokens(self.image_token_id)
        video_id = getattr(hf_config, "video_token_id", None)  # None: the model takes no videos
        self.video_token = None if video_id is None else self.processor.tokenizer.convert_ids_to_tokens(video_id)
        self.pixel_dtype: torch.dtype | None = None  # set by a server: the engine's model dtype (see _features)
        self._owner = threading.get_ident()  # the thread that may use self.processor itself
        self._copies = threading.local()

    @property
    def takes_videos(self) -> bool:
        return getattr(self.model_cls, "video_style", None) is not None

    @property
    def model_name(self) -> str:
        """The architecture, as refusals name the model (e.g. LlavaNextForConditionalGeneration)."""
        return (getattr(self.hf_config, "architectures", None) or [self.model_cls.__name__])[0]

    def _thread_processor(self):
        if threading.get_ident() == self._owner:
            return self.processor
        proc = getattr(self._copies, "processor", None)
        if proc is None:
            proc = self._copies.processor = copy.deepcopy(self.processor)
        return proc

    def warm_up(self) -> None:
        """One small image through the calling thread's processor copy, so that the copy, the processor's lazy
        imports and its first allocations happen at start-up rather than in the first requests."""
        from PIL import Image

        self.process(f"{self.image_token}\ndescribe", [Image.new("RGB", (64, 48), (127, 127, 127))])

    def process(self, prompt: str, images: list, add_special_tokens: bool = True, videos: list | None = None
                ) -> tuple[list[int], RequestExtras]:
        """(token ids, the request's extras: one feature per image (and per video, or per frame group where the
        model splits a video so: `split_videos`) in prompt order, the bidirectional prefix length). `videos`:
        [(frames, metadata or None)] (as_video_list)."""
        for what, n in (("image", len(images)), ("video", len(videos or []))):
            limit = self.limits.get(what, 4)
            if n > limit:
                raise InvalidRequest(f"{n} {what}s in one prompt; at most {limit} are allowed "
                                     f"(--limit-mm-per-prompt {what}: {limit})", param="multi_modal_data")
        if videos and not self.takes_videos:
            raise InvalidRequest(f"{self.model_name} does not take videos", param="multi_modal_data")
        video_kw = {}
        if videos:
            video_kw = {"videos": [v for v, _ in videos]}
            if any(m is not None for _, m in videos):
                video_kw["video_metadata"] = [m for _, m in videos]
            if all(m and m.get("frames_indices") for _, m in videos):  # sampled already (a video_url's frames):
                video_kw["do_sample_frames"] = False  # transformers' Qwen3-VL processor would sample them again
        try:
            enc = self._thread_processor()(text=[prompt], images=[images] if images else None, return_tensors="pt",
                                           add_special_tokens=add_special_tokens, **video_kw)
        except InvalidRequest:
            raise
        except Exception as e:  # the processor's checks (image count vs placeholders, bad pixels) are input errors
            raise InvalidRequest(f"the image processor rejected the request: {e}", param="multi_modal_data") from e
        ids = enc["input_ids"][0].tolist()
        features: list[MMFeature] = []
        in_videos = self._video_placeholders(ids) if videos else []
        if images:
            skip = set(in_videos)
            features = self._features(enc, len(images), [i for i, t in enumerate(ids)
                                                          if t == self.image_token_id and i not in skip])
        if videos:
            per_video = self.model_cls.split_videos(self.hf_config, enc)
            features = sorted(features + self._features(enc, len(per_video), in_videos, per_video, "video"),
                              key=lambda f: f.offset)
        bidir = 0
        if self.bidirectional_prefix and "token_type_ids" in enc:
            types = enc["token_type_ids"][0]
            nonzero = (types != 0).nonzero()
            bidir = int(nonzero[0]) if len(nonzero) else len(ids)  # the prefix: token type 0 (image + prompt)
        return ids, RequestExtras(mm_features=features, bidirectional_len=bidir)

    def _video_placeholders(self, ids: list[int]) -> list[int]:
        """Where the videos' placeholders are: the model's `video_placeholders` (GLM-4.xV: image tokens inside
        video spans), else the video token's positions."""
        find = getattr(self.model_cls, "video_placeholders", None)
        if find is not None:
            return find(self.hf_config, ids)
        return [i for i, t in enumerate(ids) if t == self.hf_config.video_token_id]

    def _features(self, enc, num_images: int, positions: list[int], per_image: list | None = None,
                  modality: str = "image") -> list[MMFeature]:
        """One feature per item of `per_image` (the model's split of the processor's outputs; its images by
        default) on the runs of placeholder `positions`, in order."""
        if per_image is None:
            per_image = self.model_cls.split_images(self.hf_config, enc)
        if len(per_image) != num_images:
            raise InvalidRequest(f"{num_images} images given, the processor produced {len(per_image)}",
                                 param="multi_modal_data")
        features, used = [], 0
        for k, data in enumerate(per_image):
            n = self.model_cls.num_image_tokens(self.hf_config, data)
            run = positions[used:used + n]
            if len(run) != n or run[-1] - run[0] != n - 1:
                raise InvalidRequest(f"image {k} needs {n} contiguous placeholder tokens in the prompt",
                                     param="multi_modal_data")
            # the towers cast pixels to the model dtype first, so casting here changes no result and halves what is
            # hashed, sent to the engine core and copied to the device (bf16 vs the processor's float32)
            tensors = {name: t.to(self.pixel_dtype) if self.pixel_dtype is not None and name.startswith("pixel_values")
                       else t for name, t in data.items() if torch.is_tensor(t)}
            features.append(MMFeature(run[0], n, hash_tensors(tensors),
                                      {name: TensorData.from_tensor(t) for name, t in tensors.items()}, modality))
            used += n
        if used != len(positions):
            raise InvalidRequest(f"the prompt has {len(positions)} image placeholder tokens, the images need {used}",
                                 param="multi_modal_data")
        return features

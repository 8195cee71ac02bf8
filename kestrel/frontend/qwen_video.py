"""Qwen-VL video preprocessing without torchvision: what transformers' Qwen2VLVideoProcessor (Qwen2-VL, Qwen2.5-VL)
and Qwen3VLVideoProcessor (Qwen3-VL, Qwen3.5) compute, which import torchvision. A video is its frames (a list of
PIL images or an array [T, H, W, 3] of uint8), optionally with vLLM's metadata ({"fps": ..., "frames_indices":
...}); without metadata a video is taken as transformers takes one: 24 frames per second, its frames numbered 0..T-1.

Steps, as transformers': frames sampled (Qwen3-VL's processor samples `fps` frames per second, at least
`min_frames`; Qwen2-VL's keeps them all), resized to a size `smart_resize` picks (multiples of patch x merge,
within the pixel budget: per frame in Qwen2-VL, over all frames in Qwen3-VL) by antialiased bicubic interpolation
rounded back to uint8 (torchvision's tensor resize), rescaled and normalised in one step, the frame count padded
to a multiple of the temporal patch with the last frame, and cut into patches in the order the tower reads
(2x2 merge blocks consecutive). Outputs carry transformers' names: pixel_values_videos, video_grid_thw, and the
metadata (fps, frames_indices) the processors' prompt expansion reads."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

OPENAI_CLIP_MEAN, OPENAI_CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

# transformers' class defaults per style: Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
DEFAULTS = {
    "qwen2_vl": dict(size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, image_mean=OPENAI_CLIP_MEAN,
                     image_std=OPENAI_CLIP_STD, patch_size=14, temporal_patch_size=2, merge_size=2, min_frames=4,
                     max_frames=768, do_sample_frames=False, fps=None, num_frames=None),
    "qwen3_vl": dict(size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, image_mean=[0.5] * 3,
                     image_std=[0.5] * 3, patch_size=16, temporal_patch_size=2, merge_size=2, min_frames=4,
                     max_frames=768, do_sample_frames=True, fps=2, num_frames=None),
}
DEFAULT_VIDEO_FPS = 24  # transformers' assumption for frames given without metadata


@dataclass
class VideoMetadata:
    """What the prompt expansion reads: the source's frame rate and the indices of the frames kept."""
    total_num_frames: int
    fps: float
    frames_indices: list[int] = field(default_factory=list)
    duration: float | None = None  # seconds, where the metadata says (GLM-4.xV's sampling reads it)

    @property
    def sampled_fps(self) -> float:
        return len(self.frames_indices) / self.total_num_frames * self.fps

    @property
    def timestamps(self) -> list[float]:
        """Each kept frame's time in seconds (GLM-4.xV's prompt writes them)."""
        return [i / self.fps for i in self.frames_indices]


def as_frames(video) -> np.ndarray:
    """A video's frames as uint8 [T, H, W, 3]."""
    from PIL import Image

    if isinstance(video, (list, tuple)):
        if not video or not all(isinstance(f, Image.Image) for f in video):
            raise ValueError("a video is a non-empty list of PIL images or an array [T, H, W, 3]")
        return np.stack([np.asarray(f.convert("RGB")) for f in video])
    arr = np.asarray(video)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"a video array must be [T, H, W, 3], not {list(arr.shape)}")
    return arr.astype(np.uint8, copy=False)


def _check_aspect(height: int, width: int) -> None:
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")


def _fit(height: int, width: int, factor: int, pixels: int, min_pixels: int, max_pixels: int, beta_pixels: int
         ) -> tuple[int, int]:
    """Sides rounded to multiples of `factor`; scaled down (floor) when `pixels` (the rounded size's count) exceed
    max_pixels, up (ceil) when below min_pixels, by sqrt(beta_pixels / bound)."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if pixels(h, w) > max_pixels:
        beta = math.sqrt(beta_pixels / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif pixels(h, w) < min_pixels:
        beta = math.sqrt(min_pixels / beta_pixels)
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def smart_resize_frame(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's: both sides multiples of `factor`, the frame's pixels within [min_pixels, max_pixels], the aspect
    ratio kept as closely as possible."""
    _check_aspect(height, width)
    return _fit(height, width, factor, lambda h, w: h * w, min_pixels, max_pixels, height * width)


def smart_resize_video(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's: the budget covers all frames (rounded to the temporal patch), and a side shorter than `factor`
    is scaled up first."""
    if frames < temporal:
        raise ValueError(f"t:{frames} must be larger than temporal_factor:{temporal}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    t = round(frames / temporal) * temporal
    return _fit(height, width, factor, lambda h, w: t * h * w, min_pixels, max_pixels, frames * height * width)


class QwenVideoProcessor:
    styles = DEFAULTS

    def __init__(self, style: str, frame_max_pixels: int | None = None, **settings):
        """`style`: "qwen2_vl" or "qwen3_vl" (resize rule, sampling, defaults); `settings` override the
        defaults (a checkpoint's video_preprocessor_config.json, --mm-processor-kwargs). `frame_max_pixels`: no
        frame larger (the model's largest image: what the memory profile holds room for; a budget over all frames
        would give a short video larger frames, GLM-4.xV's up to twice that)."""
        self.frame_max_pixels = frame_max_pixels
        defaults = self.styles[style]
        cfg = {**defaults, **{k: v for k, v in settings.items() if k in defaults}}
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if style == "qwen2_vl" and settings.get(key) is not None:  # Qwen3VLVideoProcessor ignores them
                cfg["size"] = {**cfg["size"], edge: settings[key]}
        self.style = style
        self.__dict__.update(cfg)
        self.rescale_factor = settings.get("rescale_factor", 1 / 255)

    @classmethod
    def from_pretrained(cls, path: str, style: str, frame_max_pixels: int | None = None,
                        **overrides) -> "QwenVideoProcessor":
        """The checkpoint's settings where transformers reads them, first found: processor_config.json's
        "video_processor", video_preprocessor_config.json, then preprocessor_config.json (the image processor's,
        as released Qwen2.5-VL checkpoints have only that)."""
        folder = Path(path)
        settings: dict = {}
        nested = folder / "processor_config.json"
        if nested.exists():
            settings = json.loads(nested.read_text()).get("video_processor") or {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if not settings and (folder / name).exists():
                settings = json.loads((folder / name).read_text())
        return cls(style, frame_max_pixels, **{**settings, **overrides})

    @staticmethod
    def metadata(frames: np.ndarray, given: dict | None) -> VideoMetadata:
        """A video's metadata from what the caller gave (None: 24 fps, the frames not sampled yet)."""
        given = given or {}
        return VideoMetadata(int(given.get("total_num_frames") or len(frames)),
                             float(given.get("fps") or DEFAULT_VIDEO_FPS), list(given.get("frames_indices") or []),
                             given.get("duration"))

    def sample(self, frames: np.ndarray, meta: VideoMetadata) -> tuple[np.ndarray, VideoMetadata]:
        """Qwen3-VL's sampling: `fps` frames per second of the source (at least min_frames, at most max_frames and
        the frames there are), evenly spaced, first and last kept. Frames whose metadata names their indices were
        sampled already."""
        if not self.do_sample_frames or meta.frames_indices:
            meta.frames_indices = meta.frames_indices or list(range(len(frames)))
            return frames, meta
        total = len(frames)
        n = self.num_frames
        if n is None and self.fps is not None:
            n = min(max(int(total / meta.fps * self.fps), self.min_frames), self.max_frames, total)
        if n is None:
            n = min(max(total, self.min_frames), self.max_frames)
        idx = np.linspace(0, total - 1, n).round().astype(int)
        meta.frames_indices = idx.tolist()
        return frames[idx], meta

    def resize(self, video: torch.Tensor) -> torch.Tensor:
        """[T, 3, H, W] uint8 -> the size smart_resize picks (torchvision's antialiased bicubic on uint8)."""
        t, _, height, width = video.shape
        factor = self.patch_size * self.merge_size
        lo, hi = self.size["shortest_edge"], self.size["longest_edge"]
        if self.style == "qwen2_vl":
            h, w = smart_resize_frame(height, width, factor, lo, hi)
        else:
            h, w = smart_resize_video(t, height, width, self.temporal_patch_size, factor, lo, hi)
        if self.frame_max_pixels and h * w > self.frame_max_pixels:
            h, w = smart_resize_frame(height, width, factor, factor * factor, self.frame_max_pixels)
        out = F.interpolate(video.float(), size=[h, w], mode="bicubic", align_corners=False, antialias=True)
        return out.clamp_(0, 255).round_().to(torch.uint8)

    def patchify(self, video: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """[T, C, H, W] float -> ([t*h*w, C*T_p*P*P] patches, [t, h, w])."""
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -video.shape[0] % tp:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        t, c, height, width = video.shape
        gt, gh, gw = t // tp, height // p, width // p
        x = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]

    def __call__(self, videos: list, video_metadata: list | None = None, **_ignored) -> dict:
        """`videos`: each a list of PIL frames or an array [T, H, W, 3]; `video_metadata`: per video a dict
        (fps, frames_indices, total_num_frames) or None."""
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(1, 3, 1, 1) / self.rescale_factor
        std = torch.tensor(self.image_std, dtype=torch.float32).view(1, 3, 1, 1) / self.rescale_factor
        pixels, grids, metas = [], [], []
        for i, video in enumerate(videos):
            frames = as_frames(video)
            frames, meta = self.sample(frames, self.metadata(frames, (video_metadata or [None] * len(videos))[i]))
            x = self.resize(torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2))
            patches, grid = self.patchify((x.float() - mean) / std)
            pixels.append(patches)
            grids.append(grid)
            metas.append(meta)
        return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids),
                "video_metadata": metas}

"""GLM-4.xV video preprocessing without torchvision: what transformers' Glm4vVideoProcessor (GLM-4.1V, GLM-4.5V)
and Glm46VVideoProcessor (the `glm46v` layout) compute. Resizing, normalising and patches are Qwen3-VL's
(kestrel/frontend/qwen_video.py: the pixel budget over all frames, the frame count padded to the temporal patch
with the last frame); the frame sampling is GLM's own, and needs the source's frame rate:
- "glm4v": `fps` frames per second (default 2) over the video's duration (at most `max_duration` seconds, else
  evenly spread), frame i at ceil(i x source fps / fps);
- "glm46v": a rate by duration (3 per second up to 30 s, 1 up to 300 s, 0.5 beyond; times the temporal patch,
  at most 640 frames), one frame per interval and evenly respaced when there are too few or too many;
then, both, repeated indices dropped and the last one repeated to an even count. Frames given with their indices
(a video_url's, see kestrel/frontend/video_decode.py) are sampled already; frames given without any metadata are
kept as given, at transformers' assumed 24 fps (transformers' processor would refuse to sample them)."""
from __future__ import annotations

import math

import numpy as np

from kestrel.frontend.qwen_video import DEFAULT_VIDEO_FPS, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, QwenVideoProcessor, \
    VideoMetadata

_GLM = dict(size={"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000}, image_mean=OPENAI_CLIP_MEAN,
            image_std=OPENAI_CLIP_STD, patch_size=14, temporal_patch_size=2, merge_size=2, do_sample_frames=True,
            fps=2, max_duration=300)
# glm46v's rates by duration: (up to seconds, frames per second)
RATES_46V, MAX_SECONDS_46V, MAX_FRAMES_46V = ((30, 3), (300, 1), (math.inf, 0.5)), 2400, 640


def _even_unique(indices) -> list[int]:
    out = list(dict.fromkeys(int(i) for i in indices))
    return out + out[-1:] if len(out) % 2 else out


class GlmVideoProcessor(QwenVideoProcessor):
    styles = {"glm4v": _GLM, "glm46v": _GLM}

    @staticmethod
    def metadata(frames: np.ndarray, given: dict | None) -> VideoMetadata:
        if not given:
            return VideoMetadata(len(frames), DEFAULT_VIDEO_FPS, list(range(len(frames))))
        return QwenVideoProcessor.metadata(frames, given)

    def sample(self, frames: np.ndarray, meta: VideoMetadata) -> tuple[np.ndarray, VideoMetadata]:
        if not self.do_sample_frames or meta.frames_indices:
            meta.frames_indices = meta.frames_indices or list(range(len(frames)))
            return frames, meta
        last = meta.total_num_frames - 1
        duration = meta.duration or round(last / meta.fps) + 1
        pick = self._indices_46v if self.style == "glm46v" else self._indices_4v
        meta.frames_indices = _even_unique(pick(meta.total_num_frames, meta.fps, duration))
        return frames[meta.frames_indices], meta

    def _indices_4v(self, total: int, fps: float, duration: float) -> list[int]:
        if duration <= self.max_duration:
            n = max(math.floor(duration * self.fps), 1)
            return [min(total - 1, math.ceil(i * fps / self.fps)) for i in range(n)]
        n = int(self.max_duration * self.fps)
        if n >= total:
            return list(range(total))
        return [min(total - 1, math.ceil(t * fps)) for t in np.linspace(0, duration, n)]

    def _indices_46v(self, total: int, fps: float, duration: float) -> list[int]:
        span = min(duration, MAX_SECONDS_46V)
        rate = next(r for limit, r in RATES_46V if span <= limit)
        want = min(int(span * rate * self.temporal_patch_size), MAX_FRAMES_46V)
        picked: list[int] = []
        if total >= want:
            step, due = 1 / (self.temporal_patch_size * rate), 0.0
            for i in range(total):
                if i * (1 / fps) >= due:  # transformers' float steps
                    due += step
                    picked.append(i)
                    if due >= int(duration):
                        break
        if len(picked) < want:
            start, end = (picked[0], picked[-1]) if picked else (0, max(total - 1, 0))
            return np.linspace(start, end, want, dtype=int).tolist()
        return np.linspace(0, total - 1, want, dtype=int).tolist() if len(picked) > want else picked

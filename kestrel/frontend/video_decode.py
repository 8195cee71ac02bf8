"""A video_url's bytes -> frames, as vLLM's default video loader gives them: decoded with PyAV (the optional `av`
package; without it video_url parts are refused by name), `num_frames` frames kept (vLLM's default 32; -1 keeps
every frame), spaced evenly over the whole video with the first and the last (np.linspace over frame indices,
truncated), and the metadata the Qwen-VL processors read: the source's frame count and rate and the indices of the
frames kept (so the processor samples no further). Only the kept frames are converted to RGB. Every refusal is an
InvalidRequest (HTTP 400) naming the content part."""
from __future__ import annotations

import io

import numpy as np

from kestrel.errors import InvalidRequest

DEFAULT_NUM_FRAMES = 32  # vLLM's VideoMediaIO default (--media-io-kwargs '{"video": {"num_frames": N}}')
NO_PYAV = "video_url parts need PyAV (the `av` package), which is not installed on this server"


def have_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def sample_indices(total: int, num_frames: int) -> list[int]:
    """vLLM's uniform sampling: every frame when num_frames is -1 or more than there are, else num_frames indices
    from 0 to total - 1 evenly spaced (truncated)."""
    if num_frames == -1 or total <= num_frames:
        return list(range(total))
    return np.linspace(0, total - 1, num_frames).astype(int).tolist()


def decode_video(raw: bytes, cfg, param: str, num_frames: int = DEFAULT_NUM_FRAMES) -> tuple[np.ndarray, dict]:
    """(frames uint8 [T, H, W, 3], {"total_num_frames", "fps", "duration", "frames_indices"}) under the media limits
    (--max-image-bytes for the encoded video, --max-image-pixels for one frame)."""
    if len(raw) > cfg.max_image_bytes:
        raise InvalidRequest(f"video of {len(raw)} bytes exceeds the limit of {cfg.max_image_bytes}", param=param)
    try:
        import av
    except ImportError:
        raise InvalidRequest(NO_PYAV, param=param) from None
    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.video:
                raise InvalidRequest("the video has no video stream", param=param)
            stream = container.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
            if w * h > cfg.max_image_pixels:
                raise InvalidRequest(f"video frames of {w}x{h} pixels exceed the limit of {cfg.max_image_pixels}",
                                     param=param)
            rate = stream.average_rate or stream.base_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            total = stream.frames
            if total <= 0:  # the container does not say: count the packets (no decoding)
                total = sum(1 for p in container.demux(stream) if p.size)
        wanted = set(sample_indices(total, num_frames))
        frames, kept = [], []
        with av.open(io.BytesIO(raw), mode="r") as container:  # anew: not every stream can seek back
            stream = container.streams.video[0]
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    arr = frame.to_ndarray(format="rgb24")
                    if arr.shape[0] * arr.shape[1] > cfg.max_image_pixels:
                        raise InvalidRequest(f"video frames of {arr.shape[1]}x{arr.shape[0]} pixels exceed the "
                                             f"limit of {cfg.max_image_pixels}", param=param)
                    frames.append(arr)
                    kept.append(i)
                if i >= total - 1 and len(kept) == len(wanted):
                    break
    except InvalidRequest:
        raise
    except Exception as e:  # PyAV's errors (InvalidDataError, ...): the caller's bytes
        raise InvalidRequest(f"cannot decode the video: {e}", param=param) from e
    if not frames:
        raise InvalidRequest("cannot decode the video: no frames", param=param)
    if len({f.shape for f in frames}) != 1:
        raise InvalidRequest("cannot decode the video: its frames change size", param=param)
    meta = {"total_num_frames": total, "fps": fps, "duration": total / fps if fps else 0.0,
            "frames_indices": kept}
    return np.stack(frames), meta

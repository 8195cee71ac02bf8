"""Issue 52: video_url content parts in the frontend, no server: a tiny mp4 (PyAV encodes it here) as a data URL and
from an allowed host decodes to its frames with vLLM's metadata, sampled as vLLM's default loader does (32 frames,
or --media-io-kwargs' num_frames, evenly spaced with the first and last); per-modality --limit-mm-per-prompt
counts; undecodable, oversized and disallowed videos, and a server without PyAV, get an InvalidRequest (400)
naming the content part."""
from __future__ import annotations

import base64
import io
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kestrel.config import MultiModalConfig
from kestrel.errors import InvalidRequest
from kestrel.frontend.media import resolve_image_parts

av = pytest.importorskip("av")


def mp4_bytes(frames: np.ndarray, fps: int = 2, container: str = "mp4") -> bytes:
    """uint8 [T, H, W, 3] frames (even sides) -> an H.264 mp4 (or another container)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def decoded(raw: bytes) -> np.ndarray:
    """Every frame of an mp4, as PyAV decodes it (the test's own reading, not Kestrel's)."""
    with av.open(io.BytesIO(raw)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def video_data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def video_parts(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "video_url", "video_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": "what happens?"}]}]


def frames(n: int, h: int = 32, w: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def resolved_video(messages, cfg):
    (msg,) = resolve_image_parts(messages, cfg)
    (part,) = [p for p in msg["content"] if p["type"] == "video"]
    return part["video"]


def test_data_url_decodes_to_its_frames_with_vllms_metadata():
    raw = mp4_bytes(frames(4), fps=2)
    got, meta = resolved_video(video_parts(video_data_url(raw)), MultiModalConfig())
    assert np.array_equal(got, decoded(raw))
    assert meta == {"total_num_frames": 4, "fps": 2.0, "duration": 2.0, "frames_indices": [0, 1, 2, 3]}


def test_frames_sampled_as_vllm_does():
    raw = mp4_bytes(frames(40), fps=10)
    every = decoded(raw)
    got, meta = resolved_video(video_parts(video_data_url(raw)), MultiModalConfig())  # vLLM keeps 32
    assert meta["frames_indices"] == np.linspace(0, 39, 32).astype(int).tolist() and len(got) == 32
    cfg = MultiModalConfig(media_io_kwargs={"video": {"num_frames": 8}})
    got, meta = resolved_video(video_parts(video_data_url(raw)), cfg)
    assert meta["frames_indices"] == [0, 5, 11, 16, 22, 27, 33, 39] and meta["total_num_frames"] == 40
    assert np.array_equal(got, every[meta["frames_indices"]])
    cfg = MultiModalConfig(media_io_kwargs={"video": {"num_frames": -1}})
    assert len(resolved_video(video_parts(video_data_url(raw)), cfg)[0]) == 40


@pytest.mark.parametrize("container", ["matroska", "h264"])
def test_containers_that_do_not_count_their_frames(container):
    """Matroska and a bare H.264 stream give no frame count: the packets are counted (a bare stream cannot seek
    back, so it is opened again to decode)."""
    raw = mp4_bytes(frames(12), fps=4, container=container)
    got, meta = resolved_video(video_parts(video_data_url(raw)),
                               MultiModalConfig(media_io_kwargs={"video": {"num_frames": 4}}))
    assert meta["total_num_frames"] == 12 and meta["frames_indices"] == [0, 3, 7, 11]
    assert np.array_equal(got, decoded(raw)[[0, 3, 7, 11]])


def test_limits_count_each_modality():
    url = video_data_url(mp4_bytes(frames(2)))
    cfg = MultiModalConfig(limit_mm_per_prompt={"image": 0, "video": 1})
    assert len(resolve_image_parts(video_parts(url), cfg)[0]["content"]) == 2  # images at 0 leave videos alone
    with pytest.raises(InvalidRequest, match=r"too many videos: at most 1 .*\(--limit-mm-per-prompt video: 1\)") as e:
        resolve_image_parts(video_parts(url, url), cfg)
    assert e.value.param == "messages[0].content[1]"
    with pytest.raises(InvalidRequest, match="too many videos: at most 0"):
        resolve_image_parts(video_parts(url), MultiModalConfig(limit_mm_per_prompt=0))


@pytest.mark.parametrize("url,why", [
    ("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode(), "cannot decode the video"),
    ("data:image/png;base64,AAAA", "a data URL must be data:video/<type>;base64"),
    ("data:video/mp4;base64,@@@", "invalid base64 video data"),
    ("http://videos.example.org/v.mp4", "a video URL on 'videos.example.org' is not allowed"),
    ("file:///etc/passwd", "local files are not allowed"),
    ("ftp://x/v.mp4", "unsupported video URL scheme 'ftp'"),
])
def test_bad_videos_are_refused(url, why):
    with pytest.raises(InvalidRequest, match=why) as e:
        resolve_image_parts(video_parts(url), MultiModalConfig())
    assert e.value.param.startswith("messages[0].content[0]")


def test_size_limits():
    raw = mp4_bytes(frames(2, 64, 64))
    with pytest.raises(InvalidRequest, match=f"video of {len(raw)} bytes exceeds the limit of 100"):
        resolve_image_parts(video_parts(video_data_url(raw)), MultiModalConfig(max_image_bytes=100))
    with pytest.raises(InvalidRequest, match="video frames of 64x64 pixels exceed the limit of 1000"):
        resolve_image_parts(video_parts(video_data_url(raw)), MultiModalConfig(max_image_pixels=1000))


def test_without_pyav_video_url_is_refused_by_name(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    with pytest.raises(InvalidRequest, match=r"video_url parts need PyAV \(the `av` package\)"):
        resolve_image_parts(video_parts("data:video/mp4;base64,AAAA"), MultiModalConfig())


def test_allowed_host_serves_a_video():
    raw = mp4_bytes(frames(3), fps=3)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        cfg = replace(MultiModalConfig(), allowed_media_domains=["127.0.0.1"], allow_private_media_addresses=True)
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v.mp4"
        got, meta = resolved_video(video_parts(url), cfg)
        assert np.array_equal(got, decoded(raw)) and meta["fps"] == 3.0
        with pytest.raises(InvalidRequest, match="non-public address"):  # the image policy, for videos too
            resolve_image_parts(video_parts(url), replace(cfg, allow_private_media_addresses=False))
    finally:
        httpd.shutdown()
        httpd.server_close()

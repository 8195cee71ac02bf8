"""Images (image_url) and videos (video_url, decoded by kestrel/frontend/video_decode.py) named by URL in chat
messages, under one policy: `data:` URLs always; http(s) URLs only for hosts in
--allowed-media-domains, at every redirect, and never to internal addresses (media_fetch.py); file:// URLs only under --allowed-local-media-path. Every refusal is an InvalidRequest
(HTTP 400) naming the content part."""
from __future__ import annotations

import binascii
import io
import os
import urllib.parse

import pybase64

from kestrel.errors import InvalidRequest
from kestrel.frontend.media_fetch import fetch_image


def decode_image(raw: bytes, cfg, param: str):
    from PIL import Image

    if len(raw) > cfg.max_image_bytes:
        raise InvalidRequest(f"image of {len(raw)} bytes exceeds the limit of {cfg.max_image_bytes}", param=param)
    try:
        img = Image.open(io.BytesIO(raw))
        w, h = img.size
        if w * h > cfg.max_image_pixels:
            raise InvalidRequest(f"image of {w}x{h} pixels exceeds the limit of {cfg.max_image_pixels}", param=param)
        img.load()
        return img.convert("RGB")
    except InvalidRequest:
        raise
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, DecompressionBombError, OSError...)
        raise InvalidRequest(f"cannot decode the image: {e}", param=param) from e


def _data_url(url: str, param: str, kind: str = "image") -> bytes:
    head, _, payload = url.partition(",")
    if not head.startswith(f"data:{kind}/") or ";base64" not in head:
        raise InvalidRequest(f"a data URL must be data:{kind}/<type>;base64,<data>", param=param)
    try:  # pybase64 (SIMD): binascii held the GIL for ~9 ms per 3 MB image, a third of a render's GIL time
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"invalid base64 {kind} data: {e}", param=param) from e


def _local_file(url: str, cfg, param: str) -> bytes:
    if not cfg.allowed_local_media_path:
        raise InvalidRequest("local files are not allowed (start the server with --allowed-local-media-path)",
                             param=param)
    root = os.path.realpath(cfg.allowed_local_media_path)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    if os.path.commonpath([root, path]) != root:
        raise InvalidRequest(f"{path} is outside the allowed media folder", param=param)
    try:
        with open(path, "rb") as f:
            return f.read(cfg.max_image_bytes + 1)
    except OSError as e:
        raise InvalidRequest(f"cannot read {path}: {e.strerror}", param=param) from e


def _url_bytes(url: str, cfg, param: str, kind: str) -> bytes:
    head, colon, _ = url[:16].partition(":")  # not urlparse: a data URL is megabytes
    scheme = head.lower() if colon else ""
    if scheme == "data":
        return _data_url(url, param, kind)
    if scheme == "file":
        return _local_file(url, cfg, param)
    if scheme in ("http", "https"):
        return fetch_image(url, cfg, param, kind)
    raise InvalidRequest(f"unsupported {kind} URL scheme {scheme!r}", param=param)


def load_image_url(url: str, cfg, param: str):
    """The PIL image (RGB) behind an image_url, under the server's media policy (kestrel.config.MultiModalConfig)."""
    return decode_image(_url_bytes(url, cfg, param, "image"), cfg, param)


def load_video_url(url: str, cfg, param: str):
    """The (frames [T, H, W, 3], metadata) behind a video_url, under the same policy as images; refused by name
    where PyAV is not installed (before anything is fetched)."""
    from kestrel.frontend.video_decode import NO_PYAV, decode_video, have_pyav

    if not have_pyav():
        raise InvalidRequest(NO_PYAV, param=param)
    return decode_video(_url_bytes(url, cfg, param, "video"), cfg, param, cfg.video_num_frames())


def _count(counts: dict, kind: str, cfg, param: str) -> None:
    counts[kind] = counts.get(kind, 0) + 1
    limit = cfg.limit(kind)
    if counts[kind] > limit:
        raise InvalidRequest(f"too many {kind}s: at most {limit} are allowed in one request "
                             f"(--limit-mm-per-prompt {kind}: {limit})", param=param)


def resolve_image_parts(messages: list[dict], cfg) -> list[dict]:
    """OpenAI content parts -> the parts the chat renderer takes: image_url parts become {"type": "image",
    "image": PIL image}, video_url parts {"type": "video", "video": (frames, metadata)}; at most
    cfg.limit(modality) of each (--limit-mm-per-prompt)."""
    out, counts = [], {}
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            param = f"messages[{i}].content[{j}]"
            if kind == "image_url":
                _count(counts, "image", cfg, param)
                url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
                if not url:
                    raise InvalidRequest("an image_url part needs image_url.url", param=param)
                parts.append({"type": "image", "image": load_image_url(url, cfg, f"{param}.image_url")})
            elif kind == "video_url":
                _count(counts, "video", cfg, param)
                url = (part.get("video_url") or {}).get("url") if isinstance(part.get("video_url"), dict) else None
                if not url:
                    raise InvalidRequest("a video_url part needs video_url.url", param=param)
                parts.append({"type": "video", "video": load_video_url(url, cfg, f"{param}.video_url")})
            elif kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif kind == "image":
                _count(counts, "image", cfg, param)
                parts.append(part)
            elif kind == "video":  # frames given in process (LLM.chat): a list of PIL images or [T, H, W, 3]
                _count(counts, "video", cfg, param)
                parts.append(part)
            else:
                raise InvalidRequest(f"content part type {kind!r} is not supported", param=param)
        out.append({**m, "content": parts})
    return out

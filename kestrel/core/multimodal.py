"""Multimodal inputs as the engine core and the runner see them: per image, the processed tensors the vision
encoder reads, where its placeholder tokens sit in the prompt, and a hash of its content. msgspec structs, so
they cross the process boundary as raw bytes + dtype + shape (never pickle)."""
from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                                       torch.int32, torch.uint8)}


class TensorData(msgspec.Struct, array_like=True):
    """A tensor on the wire: its bytes in C order, dtype name and shape."""
    data: bytes
    dtype: str
    shape: list[int]

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "TensorData":
        t = t.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"tensor dtype {t.dtype} cannot cross the wire")
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        return cls(raw.numpy().tobytes(), name, list(t.shape))

    def to_tensor(self, pinned: bool = False) -> torch.Tensor:
        """A host tensor of its own; ``pinned``: in page-locked memory (the source of a non-blocking GPU copy)."""
        flat = torch.empty(len(self.data), dtype=torch.uint8, pin_memory=pinned)
        flat.numpy()[:] = np.frombuffer(self.data, dtype=np.uint8)
        return flat.view(_DTYPES[self.dtype]).reshape(self.shape)


class MMFeature(msgspec.Struct, omit_defaults=True):
    """One image of a request: the encoder's inputs (`data`), its placeholder tokens prompt[offset:offset+length]
    (each gets one embedding from the model, newline embeddings included) and a content hash (prefix caching)."""
    offset: int
    length: int
    mm_hash: str
    data: dict[str, TensorData] = {}
    modality: str = "image"

    @property
    def end(self) -> int:
        return self.offset + self.length

    def tensors(self, device=None) -> dict[str, torch.Tensor]:
        """The encoder's inputs: floating tensors (pixels) on `device`, integer metadata (image sizes) on the host,
        where the model reads it as numbers (on the device, each read would wait for the queued steps). To a
        CUDA device the pixels go through pinned memory without blocking: a pageable copy would first wait for
        every step already queued, stalling the host that prepares the next one."""
        device = torch.device(device) if device is not None else None
        out = {}
        for k, v in self.data.items():
            if not _DTYPES[v.dtype].is_floating_point:
                out[k] = v.to_tensor()
            elif device is not None and device.type == "cuda":
                out[k] = v.to_tensor(pinned=True).to(device, non_blocking=True)
            else:
                out[k] = v.to_tensor().to(device)
        return out


def hash_tensors(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of the pixels
    return h.hexdigest()


def block_extra(features: list[MMFeature], start: int, end: int) -> bytes:
    """What a KV block over tokens [start, end) depends on beyond its tokens: the hashes of the images whose
    placeholders overlap it (later blocks differ through the parent hash chain)."""
    return b"".join(f.mm_hash.encode() for f in features if f.offset < end and f.end > start)

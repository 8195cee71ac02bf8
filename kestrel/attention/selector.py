"""Pick the first attention backend whose declared flags and validate() fit the model and platform."""
from __future__ import annotations

import logging

import torch

from kestrel.attention.backend import AttentionBackend
from kestrel.attention.backends.torch_ref import TorchRefBackend
from kestrel.errors import ConfigError
from kestrel.platform import Platform, current_platform

logger = logging.getLogger(__name__)


def backend_candidates() -> list[type[AttentionBackend]]:
    """Priority order: fast kernels first; the reference last (it runs everywhere)."""
    out: list[type[AttentionBackend]] = []
    try:
        from kestrel.attention.backends.triton import TritonBackend
        out.append(TritonBackend)
    except ImportError:  # triton not installed (the CPU CI)
        pass
    out.append(TorchRefBackend)
    return out


def select_attention_backend(dtype: torch.dtype, head_size: int, block_size: int, forced: str = "auto",
                             need_prefix_caching: bool = True, need_mla: bool = False,
                             platform: Platform | None = None) -> type[AttentionBackend]:
    platform = platform or current_platform()
    cands = backend_candidates()
    if forced != "auto":
        names = [c.name for c in cands]
        if forced not in names:
            raise ConfigError(f"unknown attention backend {forced!r}; available: {', '.join(names)}")
        cands = [c for c in cands if c.name == forced]
    skipped = []
    for cls in cands:
        ok, why = cls.validate(platform, dtype, head_size, block_size)
        if ok and need_prefix_caching and not cls.supports_prefix_caching:
            ok, why = False, "no prefix caching"
        if ok and need_mla != cls.supports_mla:
            ok, why = False, "MLA mismatch"
        if ok:
            logger.info("Selected attention backend %s%s", cls.name, f" (skipped: {'; '.join(skipped)})" if skipped else "")
            return cls
        skipped.append(f"{cls.name}: {why}")
    raise ConfigError("no attention backend fits: " + "; ".join(skipped))

"""Pick, for each KV-cache group, the first attention backend whose declared flags and validate() fit the group's
spec, the model's dtype, the platform and the flags the model's request features require."""
from __future__ import annotations

import logging

from kestrel.attention.backend import AttentionBackend
from kestrel.attention.backends.torch_kda import TorchKDABackend
from kestrel.attention.backends.torch_mla import TorchMLAAbsorbedBackend, TorchMLABackend
from kestrel.attention.backends.torch_ref import TorchRefBackend
from kestrel.attention.backends.torch_sparse_mla import TorchSparseMLABackend
from kestrel.core.kv_spec import KVCacheSpec
from kestrel.errors import ConfigError
from kestrel.platform import Platform, current_platform

logger = logging.getLogger(__name__)


def backend_candidates() -> list[type[AttentionBackend]]:
    """Priority order: fast kernels first; the references last (they run everywhere). Each backend reads its own
    cache kinds (full attention / sliding window, or MLA latents)."""
    out: list[type[AttentionBackend]] = []
    try:
        from kestrel.attention.backends.triton import TritonBackend
        out.append(TritonBackend)
    except ImportError:  # triton not installed (the CPU CI)
        pass
    try:
        from kestrel.attention.backends.triton_mla import TritonMLABackend
        from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend
        out += [TritonMLABackend, TritonSparseMLABackend]
    except ImportError:
        pass
    try:
        from kestrel.attention.backends.triton_kda import TritonKDABackend
        out.append(TritonKDABackend)
    except ImportError:
        pass
    out += [TorchRefBackend, TorchMLABackend, TorchMLAAbsorbedBackend, TorchKDABackend, TorchSparseMLABackend]
    return out


def select_attention_backend(spec: KVCacheSpec, block_size: int, forced: str = "auto",
                             platform: Platform | None = None, what: str = "attention",
                             requires: tuple[str, ...] = (), dtype=None) -> type[AttentionBackend]:
    """`requires`: capability flags the backend must declare True for the model's request features (the runner's
    add-ons name them, e.g. supports_bidirectional_prefix). `dtype`: the model's (default: the spec's, which
    differs for a quantised KV cache)."""
    platform = platform or current_platform()
    cands = backend_candidates()
    if forced != "auto":
        names = [c.name for c in cands]
        if forced not in names:
            raise ConfigError(f"unknown attention backend {forced!r}; available: {', '.join(names)}")
        cands = [c for c in cands if c.name == forced]
    skipped = []
    head_size = getattr(spec, "head_dim", 0)
    dtype = dtype or spec.dtype
    for cls in cands:
        ok, why = cls.validate(platform, dtype, head_size, block_size)
        if ok:
            ok, why = cls.validate_spec(spec)
        if ok:
            ok, why = cls.validate_kv_cache_dtype(platform, spec.dtype, dtype)
        missing = [flag for flag in requires if not getattr(cls, flag)]
        if ok and missing:
            ok, why = False, f"lacks {', '.join(missing)}"
        if ok:
            logger.info("Selected attention backend %s for %s%s", cls.name, what,
                        f" (skipped: {'; '.join(skipped)})" if skipped else "")
            return cls
        skipped.append(f"{cls.name}: {why}")
    raise ConfigError(f"no attention backend fits {what}: " + "; ".join(skipped))

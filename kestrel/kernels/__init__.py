"""Kernel selection as data: an ordered candidate list per layer kind, walked once at model construction."""
from __future__ import annotations

import logging
from typing import Any

from kestrel.kernels.base import KernelCandidate, LinearKernel, LinearSpec
from kestrel.kernels.dense import TorchDenseLinear
from kestrel.platform import Platform, current_platform

logger = logging.getLogger(__name__)

# Priority order per layer kind. The first candidate that is supported on the platform and can implement the
# layer wins; a candidate's gates never rely on its position here.
CANDIDATES: dict[str, list[type[KernelCandidate]]] = {
    "linear": [TorchDenseLinear],
}


class KernelSelectionError(RuntimeError):
    pass


def select(kind: str, spec: Any, backend: str = "auto", platform: Platform | None = None) -> KernelCandidate:
    """Instantiate the first kernel of `kind` that fits `spec`; `backend` restricts the walk to one name."""
    platform = platform or current_platform()
    candidates = CANDIDATES[kind]
    if backend != "auto":
        names = [c.name for c in candidates]
        if backend not in names:
            raise KernelSelectionError(f"unknown {kind} backend {backend!r}; choose one of: auto, {', '.join(names)}")
        candidates = [c for c in candidates if c.name == backend]
    skipped: list[str] = []
    for cls in candidates:
        ok, why = cls.is_supported(platform)
        if ok:
            ok, why = cls.can_implement(spec)
        if not ok:
            skipped.append(f"{cls.name}: {why}")
            continue
        layer = getattr(spec, "layer_name", "?")
        logger.debug("Selected %s for %s%s", cls.name, layer, f" (skipped: {'; '.join(skipped)})" if skipped else "")
        return cls(spec)
    layer = getattr(spec, "layer_name", "?")
    forced = f" (forced with backend={backend!r})" if backend != "auto" else ""
    raise KernelSelectionError(
        f"no {kind} kernel can serve layer {layer} on {platform.arch_name}{forced}: " + "; ".join(skipped)
    )


__all__ = ["CANDIDATES", "KernelCandidate", "KernelSelectionError", "LinearKernel", "LinearSpec", "select"]

"""The kernel-candidate interface: each kernel says honestly, on its own, where it runs and what it can serve.

Three gates, each correct without looking at the kernel's place in a priority list:

* `is_supported(platform)`: can this kernel run on the device at all (architecture, installed libraries)?
  Optional kernels answer from their row in `kestrel.platform.gates.GATES`.
* `can_implement(spec)`: can it serve this layer's configuration (shapes, dtypes, scale layout, block size)?
* `can_implement_on(spec, platform)`: joint conditions, where what the layer needs is an optional feature of the
  device (e.g. a row-wise scaled GEMM). Defaults to yes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.platform import Platform, current_platform


@dataclass(frozen=True)
class LinearSpec:
    """Everything a linear kernel needs to decide whether it can serve a layer."""

    layer_name: str
    input_size: int
    output_sizes: tuple[int, ...]  # one entry per merged shard (q/k/v, gate/up); a plain layer has one
    bias: bool
    params_dtype: torch.dtype
    quant: Any = None  # a per-layer scheme from kestrel.layers.quant (e.g. Fp8Scheme), or None for dense weights
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    @property
    def family(self) -> str:
        return "dense" if self.quant is None else self.quant.family


class KernelCandidate:
    """One entry of a priority list. Subclasses implement the gates and the weight/compute hooks."""

    name: ClassVar[str]
    kind: ClassVar[str]
    family: ClassVar[str] = "dense"  # which layers a forced backend of this name is meant for ("dense", "fp8", ...)

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def can_implement(cls, spec: Any) -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def can_implement_on(cls, spec: Any, platform: Platform) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def check(cls, spec: Any, platform: Platform) -> tuple[bool, str]:
        """All three gates in order; the first failing reason."""
        for ok, why in (cls.is_supported(platform), cls.can_implement(spec)):
            if not ok:
                return ok, why
        return cls.can_implement_on(spec, platform)

    def __init__(self, spec: Any, platform: Platform | None = None):
        self.spec = spec
        self.platform = platform if platform is not None else current_platform()
        self.skipped: tuple[str, ...] = ()  # what selection skipped before choosing this kernel (for reports)


class LinearKernel(KernelCandidate):
    kind: ClassVar[str] = "linear"

    def create_weights(self, layer: nn.Module) -> None:
        """Register the parameters this kernel's checkpoint format needs on `layer`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert loaded weights once, before the first forward."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # Prologue fusions: the layer's input transform done as the kernel loads its input, one launch instead of
    # two. None means "not fused here": the caller runs the transform, then apply().
    def apply_rms_norm(self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(apply(rmsnorm(x + residual)), x + residual) (residual None: x), or None."""
        return None

    def apply_rms_norm_silu(self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As apply_rms_norm, with SiLU-and-mul applied to the [gate | up] output, or None."""
        return None


def frozen_param(t: torch.Tensor, **attrs) -> nn.Parameter:
    """A weight-like parameter (no grad) carrying loader attributes (shard_dim, weight_loader, ...)."""
    p = nn.Parameter(t, requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class DequantisedLinear:
    """For a quantized format's linear kernels: its weights turned dense once after loading (the format's
    `dequantized_weight(layer)`, its `checkpoint_tensors` dropped), then a plain F.linear."""

    checkpoint_tensors: ClassVar[tuple[str, ...]] = ()

    def to_dense(self, layer: nn.Module) -> None:
        w = self.dequantized_weight(layer)
        for name in self.checkpoint_tensors:
            layer._parameters.pop(name, None)
        layer.weight = frozen_param(w)

    def dense_apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))


class DequantFallback(DequantisedLinear):
    """The anywhere-candidate of a quantized format: dense weights after loading, F.linear; every platform."""

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return True, ""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.to_dense(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.dense_apply(layer, x)

"""The kernel-candidate interface: each kernel says honestly, on its own, where it runs and what it can serve."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from kestrel.platform import Platform


@dataclass(frozen=True)
class LinearSpec:
    """Everything a linear kernel needs to decide whether it can serve a layer."""

    layer_name: str
    input_size: int
    output_sizes: tuple[int, ...]  # one entry per merged shard (q/k/v, gate/up); a plain layer has one
    bias: bool
    params_dtype: torch.dtype
    quant: Any = None  # a quantization config from kestrel.layers.quant, or None for dense weights
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)


class KernelCandidate:
    """One entry of a priority list. Subclasses implement the two gates and the weight/compute hooks."""

    name: ClassVar[str]
    kind: ClassVar[str]

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def can_implement(cls, spec: Any) -> tuple[bool, str]:
        raise NotImplementedError

    def __init__(self, spec: Any):
        self.spec = spec


class LinearKernel(KernelCandidate):
    kind: ClassVar[str] = "linear"

    def create_weights(self, layer: nn.Module) -> None:
        """Register the parameters this kernel's checkpoint format needs on `layer`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert loaded weights once, before the first forward."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

"""How one linear layer's FP8 weights and activations are scaled: the description the FP8 kernels consume.
The quant configs in kestrel/layers/quant/ map checkpoints onto it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
ACTIVATION_GRANULARITIES = ("tensor", "token", "group", None)  # None: weight-only FP8 (activations stay 16-bit)


@dataclass(frozen=True)
class Fp8Scheme:
    """How one linear layer's FP8 weights and activations are scaled."""

    weight: str  # "tensor" | "channel" | "block"
    activation: str | None  # "tensor" | "token" | "group" | None (weight-only)
    activation_dynamic: bool = True  # False: a calibrated static `input_scale` from the checkpoint
    block_size: tuple[int, int] | None = None  # (block_n, block_k) for weight == "block"
    group_size: int | None = None  # activation group along K for activation == "group"
    serialized: bool = True  # False: the checkpoint is unquantized and weights are quantized on load
    weight_scale_name: str = "weight_scale"  # "weight_scale_inv" for HF/DeepSeek checkpoints
    source: str = "fp8"  # "fp8" (HF), "compressed-tensors", or "online"

    family: ClassVar[str] = "fp8"

    def __post_init__(self):
        if self.weight not in WEIGHT_GRANULARITIES:
            raise ValueError(f"unknown FP8 weight granularity {self.weight!r}")
        if self.activation not in ACTIVATION_GRANULARITIES:
            raise ValueError(f"unknown FP8 activation granularity {self.activation!r}")
        if self.weight == "block" and (self.block_size is None or len(self.block_size) != 2):
            raise ValueError("block-wise FP8 needs block_size=(block_n, block_k)")
        if self.activation == "group" and not self.group_size:
            raise ValueError("per-token-group activation quantization needs group_size")
        if not self.activation_dynamic and self.activation != "tensor":
            raise ValueError("static activation scales are only supported per tensor")
        if not self.serialized and self.weight != "channel":
            raise ValueError("quantize-on-load produces per-channel weights")

    @property
    def has_input_scale(self) -> bool:
        return self.activation == "tensor" and not self.activation_dynamic

    @property
    def needs_rowwise(self) -> bool:
        """A GEMM with this scheme needs per-row scales on at least one operand."""
        return self.weight == "channel" or self.activation == "token"

    @property
    def name(self) -> str:
        w = f"block{self.block_size[0]}x{self.block_size[1]}" if self.weight == "block" else self.weight
        if self.activation is None:
            a = "none"
        elif self.activation == "group":
            a = f"group{self.group_size}"
        else:
            a = self.activation + ("" if self.activation_dynamic else "-static")
        return f"fp8[w={w},a={a}{'' if self.serialized else ',on-load'}]"


# ------------------------------------------------------------------------------------------------ matching names

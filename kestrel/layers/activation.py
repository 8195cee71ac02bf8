import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.fused import fused_ops_for


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x = [gate | up] -> gelu(gate) * up (tanh approximation: Gemma's gelu_pytorch_tanh)."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def gated_activation(name: str) -> nn.Module:
    """The gated MLP activation for an HF `hidden_act` name."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported gated activation {name!r}")

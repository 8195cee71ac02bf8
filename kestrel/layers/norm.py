import torch
from torch import nn

from kestrel.layers.fused import fused_ops_for


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: forward(x, residual) -> (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = fused_ops_for(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def pre_norm(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None):
    """A layer's input norm over the residual stream: (norm(hidden + residual), hidden + residual); before the
    first layer (residual None) the stream is the hidden state itself."""
    return (norm(hidden), hidden) if residual is None else norm(hidden, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + weight); the checkpoint stores `weight`, and after loading we keep
    1 + weight so the plain (and fused) RMSNorm kernels apply it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()
        self._offset_applied = False

    def process_weights_after_loading(self) -> None:
        if not self._offset_applied:
            self.weight.data += 1.0
            self._offset_applied = True

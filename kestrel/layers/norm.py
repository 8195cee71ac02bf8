import torch
from torch import nn

from kestrel.layers.fused import fused_ops_for


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: forward(x, residual) -> (norm(x + residual), x + residual).
    Llama's rounding: the normalised x is rounded to x's dtype before the weight scales it, as the fused Triton
    kernels (rms_norm, the GEMV's norm prologue, the q/k norm-rope prologue) compute it; `fusable` says those
    kernels may stand in for this norm."""
    fusable = True

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


class Float32RMSNorm(RMSNorm):
    """transformers' rounding for the Gemma norms: the weight held in float32 whatever the model's dtype, x
    normalised in float32, times the weight in float32, one rounding to x's dtype (Gemma 4's plain-weight norm). The
    fused kernels round the normalised x first (Llama's order), so this norm runs as PyTorch ops on every device
    (`fusable` False)."""
    fusable = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__(hidden_size, eps, torch.float32)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


class GemmaRMSNorm(Float32RMSNorm):
    """Gemma's RMSNorm (also Qwen3-Next's and Qwen3.5's) scales by (1 + weight). The checkpoint stores `weight`;
    after loading we keep 1 + weight, in float32 (bf16 would round 1 + w by up to 2**-9), in Float32RMSNorm's
    order: in bf16 the fused kernels' extra roundings doubled the relative error of the first GDN layer's output on
    tiny Qwen3.5-MoE checkpoints (CPU) and left our teacher-forced agreement below transformers' own bf16 run."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()
        self._offset_applied = False

    def process_weights_after_loading(self) -> None:
        if not self._offset_applied:
            self.weight.data += 1.0
            self._offset_applied = True


class ResidualAdd(nn.Module):
    """A pre-norm slot with no norm in it (post-norm blocks, Olmo 2/3): forward(x, residual) -> (x + residual,
    x + residual), so a layer keeps the (hidden, residual) convention of its pre-norm siblings."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        x = x + residual
        return x, x


class L2Norm(nn.Module):
    """RMSNorm without a weight (Llama 4's q/k norm); RMSNorm's constructor arguments (the size is unused)."""

    def __init__(self, hidden_size: int | None = None, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class AllHeadsRMSNorm(nn.Module):
    """One RMSNorm over all heads of q (or k) together (Olmo 2/3, MiniMax-M2): x [T, heads * head_dim] of this rank.
    Under tensor parallelism a rank holds `cols` = (first, count) of the `width` columns: the sum of squares is
    all-reduced over the ranks (divided by `replicas`, the ranks holding each column: KV heads replicated over
    ranks are counted once), and the rank keeps its slice of the weight (`load_weight` reads only it)."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype, tp=None, cols: tuple[int, int] | None = None,
                 replicas: int = 1):
        super().__init__()
        self.width, self.eps, self.tp, self.replicas = width, eps, tp, replicas
        self.cols = cols or (0, width)
        self.weight = nn.Parameter(torch.ones(self.cols[1], dtype=dtype), requires_grad=False)

    def load_weight(self, name: str, loaded) -> None:
        self.weight.data.copy_(loaded.narrow(0, *self.cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ss = xf.pow(2).sum(-1, keepdim=True)
        if self.tp is not None and self.tp.size > 1:
            ss = self.tp.all_reduce(ss) / self.replicas
        return self.weight * (xf * torch.rsqrt(ss / self.width + self.eps)).to(x.dtype)

"""Linear layers. The kernel (dense, fp8, ...) is chosen once at construction by kestrel.kernels.select."""
from __future__ import annotations

import torch
from torch import nn

from kestrel import kernels
from kestrel.kernels.base import LinearSpec


class Linear(nn.Module):
    """y = x W^T (+ b). `output_sizes` lists merged shards (q/k/v or gate/up) stacked along the output dim.
    `forward` is the one entry point; NormLinear may fuse a norm into the kernel while `fusable` is True."""

    fusable = True

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int] | tuple[int, ...],
        bias: bool = False,
        params_dtype: torch.dtype = torch.float32,
        prefix: str = "",
        quant_config=None,
        backend: str = "auto",
    ):
        super().__init__()
        sizes = (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        quant = quant_config.for_layer(prefix) if quant_config is not None else None
        self.spec = LinearSpec(prefix, input_size, sizes, bias, params_dtype, quant)
        self.kernel = kernels.select("linear", self.spec, backend)
        self.kernel.create_weights(self)

    @property
    def output_size(self) -> int:
        return self.spec.output_size

    @property
    def kernel_name(self) -> str:
        """The kernel selection chose for this layer (e.g. "torch_scaled_mm")."""
        return self.kernel.name

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy one checkpoint tensor into `param_name`, into shard `shard_id`'s rows for merged layers."""
        param = getattr(self, param_name, None)
        if not isinstance(param, torch.Tensor):
            expected = ", ".join(n for n, _ in self.named_parameters(recurse=False))
            raise KeyError(
                f"{self.spec.layer_name} ({self.kernel.name}) has no parameter {param_name!r}; it expects: {expected}"
            )
        custom = getattr(param, "weight_loader", None)
        if custom is not None:
            custom(param, loaded, shard_id)
            return
        if shard_id is None:
            if param.shape != loaded.shape:
                raise ValueError(f"{self.spec.layer_name}.{param_name}: shape {tuple(loaded.shape)} != {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        dim = getattr(param, "shard_dim", 0)
        sizes = self.spec.output_sizes
        scale = param.shape[dim] / self.spec.output_size  # >1 never; <1 for block-wise scales
        start, length = round(sum(sizes[:shard_id]) * scale), round(sizes[shard_id] * scale)
        target = param.data.narrow(dim, start, length)
        if target.shape != loaded.shape:
            raise ValueError(
                f"{self.spec.layer_name}.{param_name}[shard {shard_id}]: shape {tuple(loaded.shape)} != {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.kernel.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(self, x)

    @classmethod
    def from_ctx(cls, ctx, input_size: int, output_sizes, prefix: str, bias: bool = False) -> "Linear":
        """A linear layer with the model's dtype, quantization and kernel choice."""
        return cls(input_size, output_sizes, bias, ctx.dtype, prefix, ctx.quant_config, ctx.linear_backend)

    def extra_repr(self) -> str:
        return f"in={self.spec.input_size}, out={self.spec.output_sizes}, bias={self.spec.bias}, kernel={self.kernel.name}"

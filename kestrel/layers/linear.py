"""Linear layers. The kernel (dense, fp8, ...) is chosen once at construction by kestrel.kernels.select.

Tensor parallelism (`parallel`): a column-parallel layer keeps this rank's rows of every merged sub-matrix (its
output stays split: the next layer consumes it per rank); a row-parallel layer keeps this rank's input columns and
all-reduces its output, adding the bias once. The kernel only ever sees the local shape. Checkpoint tensors are
cut to the rank's part before they are read (lazy safetensors slices, see kestrel/loader/safetensors.py)."""
from __future__ import annotations

import torch
from torch import nn

from kestrel import kernels
from kestrel.distributed import ParallelInfo
from kestrel.kernels.base import LinearSpec


def materialize(t) -> torch.Tensor:
    """A checkpoint tensor, read if it is still a lazy slice."""
    read = getattr(t, "read", None)
    return read() if read is not None else t


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
        parallel: str | None = None,
        tp: ParallelInfo | None = None,
        output_ranges: list[tuple[int, int]] | None = None,
    ):
        """`parallel`: None (replicated), "column" or "row". `output_ranges` (column): this rank's (start, rows)
        in each merged sub-matrix, when not an equal split (KV heads replicated over ranks)."""
        super().__init__()
        sizes = (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        self.tp = tp or ParallelInfo()
        self.parallel = parallel if self.tp.size > 1 else None
        self.output_ranges = self.input_range = None
        self.full_input_size, self.full_output_sizes = input_size, sizes  # before sharding (LoRA shards to them)
        if self.parallel == "column":
            self.output_ranges = output_ranges or [self.tp.shard(n, f"{prefix} output rows") for n in sizes]
            sizes = tuple(n for _, n in self.output_ranges)
        elif self.parallel == "row":
            self.input_range = self.tp.shard(input_size, f"{prefix} input columns")
            input_size = self.input_range[1]
            self.fusable = False  # its input is already split; it is never behind a norm
        elif self.parallel is not None:
            raise ValueError(f"parallel must be None, 'column' or 'row', not {parallel!r}")
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
        loaded = self._rank_part(param_name, loaded, shard_id)
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

    def _rank_part(self, param_name: str, loaded, shard_id: int | None) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (weight or bias), read from the checkpoint only now."""
        if self.output_ranges is not None and param_name in ("weight", "bias"):
            start, length = self.output_ranges[shard_id or 0]
            return loaded.narrow(0, start, length)
        if self.input_range is not None and param_name == "weight":
            return loaded.narrow(1, *self.input_range)
        return materialize(loaded)

    def process_weights_after_loading(self) -> None:
        if self.parallel == "row" and self.tp.rank > 0 and getattr(self, "bias", None) is not None:
            self.bias.data.zero_()  # the all-reduce sums every rank's output: rank 0 alone adds the bias
        self.kernel.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.apply(self, x)
        return self.tp.all_reduce(y) if self.parallel == "row" else y

    @classmethod
    def from_ctx(cls, ctx, input_size: int, output_sizes, prefix: str, bias: bool = False,
                 parallel: str | None = None, output_ranges: list[tuple[int, int]] | None = None) -> "Linear":
        """A linear layer with the model's dtype, quantization, kernel choice and tensor-parallel group."""
        return cls(input_size, output_sizes, bias, ctx.dtype, prefix, ctx.quant_config, ctx.linear_backend,
                   parallel, ctx.parallel, output_ranges)

    def extra_repr(self) -> str:
        tp = f", {self.parallel}-parallel" if self.parallel else ""
        return f"in={self.spec.input_size}, out={self.spec.output_sizes}, bias={self.spec.bias}, kernel={self.kernel.name}{tp}"

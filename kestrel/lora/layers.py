"""LoRA on a Linear: its kernel is wrapped so that `forward` (the one entry point) returns base(x) plus each
token's adapter delta, read from per-slot stacked weights. The wrapped layer's `fusable` is set False so NormLinear
never folds the norm into the GEMM (the adapter must see the normed input).

`LoRAMapping` holds one step's token -> slot assignment, shared by every wrapped layer of one part of the model:
device buffers for the Triton kernels (graph inputs: CUDA graphs replay any mix of adapters) and, for the PyTorch
reference, the token rows of each slot. The decoder's mapping covers the step's tokens; a vision tower's or
connector's covers the rows of the one image being encoded (`exact_rows`: a layer that sees another number of rows
raises instead of leaving rows without their adapter)."""
from __future__ import annotations

import numpy as np
import torch

from kestrel.kernels.lora_layout import BLOCK_M


class LoRAMapping:
    def __init__(self, max_tokens: int, num_slots: int, device: torch.device, backend: str,
                 exact_rows: bool = False):
        self.backend = backend
        self.num_slots = num_slots
        self.exact_rows = exact_rows
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, token rows): the reference path's view
        self.num_tokens = 0
        self.num_lora_tokens = 0
        self._copied = None  # the last host -> device copy (its pinned staging buffers are reused)
        self._alloc(max_tokens, device)

    def _alloc(self, max_tokens: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        num_slots = self.num_slots
        self.sorted_h = torch.zeros(max_tokens, dtype=torch.int32, pin_memory=pin)
        self.seg_h = torch.zeros(num_slots + 1, dtype=torch.int32, pin_memory=pin)
        self.sorted_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.seg_start = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        # token blocks of the Triton kernels: (slot, first sorted row) each, -1 past the last
        blocks = -(-max_tokens // BLOCK_M) + num_slots
        self.blk_h = torch.full((2, blocks), -1, dtype=torch.int32, pin_memory=pin)
        self.blk = torch.full((2, blocks), -1, dtype=torch.int32, device=device)
        self.blk_slot, self.blk_row0 = self.blk[0], self.blk[1]

    def set(self, token_slots: np.ndarray) -> None:
        """token_slots[t]: the slot of token t's adapter, -1 for none."""
        n = len(token_slots)
        if self._copied is not None:
            self._copied.synchronize()  # an encoder mapping is set again within the step: its last copy is done
        if n > self.sorted_h.shape[0]:
            if not self.exact_rows:  # the decoder's buffers are CUDA-graph inputs: sized once for the token budget
                raise ValueError(f"{n} tokens exceed the LoRA mapping's capacity ({self.sorted_h.shape[0]})")
            self._alloc(n, self.sorted_ids.device)  # a larger image than any before (the encoder runs eagerly)
        order = np.argsort(token_slots, kind="stable")
        counts = np.bincount(token_slots[token_slots >= 0], minlength=self.num_slots)
        seg = self.seg_h.numpy()
        num_none = n - int(counts.sum())
        seg[0] = 0
        seg[1:] = np.cumsum(counts)
        lora_rows = order[num_none:]  # tokens without an adapter (-1) sort first
        self.sorted_h.numpy()[:len(lora_rows)] = lora_rows
        blk = self.blk_h.numpy()
        blk.fill(-1)
        i = 0
        for s in np.flatnonzero(counts):
            row0 = np.arange(seg[s], seg[s + 1], BLOCK_M)
            blk[0, i:i + len(row0)] = s
            blk[1, i:i + len(row0)] = row0
            i += len(row0)
        nb = self.sorted_ids.device.type == "cuda"
        self.sorted_ids[:len(lora_rows)].copy_(self.sorted_h[:len(lora_rows)], non_blocking=nb)
        self.seg_start.copy_(self.seg_h, non_blocking=nb)
        self.blk.copy_(self.blk_h, non_blocking=nb)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.num_lora_tokens = len(lora_rows)
        self.num_tokens = n
        if self.backend == "torch":
            rows = torch.from_numpy(lora_rows.astype(np.int64))
            self.groups = [(s, rows[seg[s]:seg[s + 1]].to(self.sorted_ids.device))
                           for s in range(self.num_slots) if counts[s]]

    def clear(self) -> None:
        self.set(np.zeros(0, dtype=np.int64))


def lora_delta_torch(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int,
                     shard_sizes: tuple[int, ...], groups: list[tuple[int, torch.Tensor]]) -> None:
    """The PyTorch reference: for each slot, its tokens' x @ A^T, then each shard's @ B^T, added into out. It rounds
    where the Triton kernels do: x A^T in the model dtype, the delta in float32, one rounding of out + delta (in
    bf16 the two paths then differ only by float32 summation order)."""
    for slot, rows in groups:
        whole = rows.numel() == x.shape[0]  # one adapter on every row (an image's encoder rows): no gather/scatter
        xs = x if whole else x.index_select(0, rows)
        y = (xs @ a[slot].T).float()  # [n, shards * rank]
        col = 0
        parts = []
        for i, n in enumerate(shard_sizes):
            parts.append(y[:, i * rank:(i + 1) * rank] @ b[slot, col:col + n].float().T)
            col += n
        delta = torch.cat(parts, dim=1)
        if whole:
            out.copy_(out.float() + delta)
        else:
            out.index_copy_(0, rows, (out.index_select(0, rows).float() + delta).to(out.dtype))


class LoRAKernel:
    """A Linear's kernel plus the adapters' deltas. Everything else (weights, loading, name) is the base kernel's."""

    def __init__(self, base, layer, mapping: LoRAMapping, num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.base = base
        self.mapping = mapping
        self.rank = rank
        self.shard_sizes = tuple(layer.spec.output_sizes)
        k = layer.spec.input_size
        self.lora_a = torch.zeros((num_slots, len(self.shard_sizes) * rank, k), dtype=dtype, device=device)
        self.lora_b = torch.zeros((num_slots, sum(self.shard_sizes), rank), dtype=dtype, device=device)

    def __getattr__(self, name):  # create_weights, process_weights_after_loading, apply_rms_norm, ...
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def name(self) -> str:
        return self.base.name

    def set_slot(self, slot: int, shards: list | None) -> None:
        """Write one adapter's (A, B) per shard (None: the adapter leaves that shard alone) into `slot`."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if shards is None:
            return
        col = 0
        for i, (n, ab) in enumerate(zip(self.shard_sizes, shards)):
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                self.lora_a[slot, i * self.rank:i * self.rank + r].copy_(a)
                self.lora_b[slot, col:col + n, :r].copy_(b)
            col += n

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        m = self.mapping
        if m.exact_rows and x.shape[0] != m.num_tokens:
            raise RuntimeError(f"LoRA on {self.name}: {x.shape[0]} input rows, the adapter mapping has "
                               f"{m.num_tokens}")
        if m.backend == "triton":
            from kestrel.kernels.triton_ops.lora import lora_expand, lora_shrink
            y = lora_shrink(x, self.lora_a, m)
            lora_expand(y, self.lora_b, out, m, self.rank, self.shard_sizes)
        elif m.groups:
            lora_delta_torch(x, out, self.lora_a, self.lora_b, self.rank, self.shard_sizes, m.groups)
        return out

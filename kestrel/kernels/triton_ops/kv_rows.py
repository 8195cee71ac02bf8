"""A KV tier's block copies between the device cache and pinned host memory in one launch per cache slot tensor
(kestrel/worker/kv_host_tier.py). The GPU reads or writes the pinned host rows itself, over PCIe (Triton maps a
pinned tensor's pointer to its device address): a step that loads or saves N scattered blocks of an L-layer model
costs L launches, where one cudaMemcpyAsync per block and layer cost N * L calls from Python (10,500 for a 6k-token
prefix of qwen3-0.6b) and each small copy ran far below the link's bandwidth.

Rows are copied as int32 words where their bytes allow (every KV row Kestrel lays out does), else as bytes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words a program copies (16 KiB of int32)


@triton.jit
def _copy_rows_kernel(DST, DST_IDS, SRC, SRC_IDS, row_words, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < row_words
    d = tl.load(DST_IDS + i)
    s = tl.load(SRC_IDS + i)
    words = tl.load(SRC + s * row_words + cols, mask=inside)
    tl.store(DST + d * row_words + cols, words, mask=inside)


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.shape[1] % 4 == 0 and t.dtype == torch.uint8 else t


def copy_rows_triton(dst: list[torch.Tensor], dst_ids: torch.Tensor, src: list[torch.Tensor],
                     src_ids: torch.Tensor, block: int = BLOCK, num_warps: int = 4) -> None:
    """Rows src_ids of each src tensor (2-D, contiguous) into rows dst_ids of its dst tensor, on the current
    stream; `dst_ids` / `src_ids` int64 on the device that runs the kernel (the CUDA side's). Either side may be
    pinned host memory. `block` / `num_warps`: a program's words and warps (benchmarks/kv_copy.py sweeps them)."""
    n = dst_ids.numel()
    if n == 0:
        return
    for d, s in zip(dst, src):
        d, s = _words(d), _words(s)
        row = d.shape[1]
        _copy_rows_kernel[(n, triton.cdiv(row, block))](d, dst_ids, s, src_ids, row, BLOCK=block,
                                                         num_warps=num_warps)

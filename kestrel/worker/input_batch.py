"""Persistent input buffers: host-side numpy staging (pinned on CUDA) and device tensors of fixed capacity,
so a step writes into the same memory every time (no per-step allocation; CUDA graphs replay from it)."""
from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda"

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)

        self.ids_h, self.ids_np, self.input_ids = pair(max_tokens, torch.int64)
        self.pos_h, self.pos_np, self.positions = pair(max_tokens, torch.int64)
        self.slot_h, self.slot_np, self.slot_mapping = pair(max_tokens, torch.int64)
        self.qsl_h, self.qsl_np, self.query_start_loc = pair(max_reqs + 1, torch.int32)
        self.sl_h, self.sl_np, self.seq_lens = pair(max_reqs, torch.int32)
        self.block_tables = torch.zeros((max_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        # Block tables are staged compactly ([num_reqs, width] row-major, width = this step's widest request) so
        # that the host->device copy is one contiguous range; a device-side copy then spreads the rows out.
        # (A strided host slice would go through a pageable temporary: a synchronous copy that waits for the
        # step in flight.)
        self.bt_flat_h, self.bt_flat_np, self.bt_flat = pair(max_reqs * max_blocks_per_req, torch.int32)
        self.fill_dst_h, self.fill_dst_np, self.fill_dst = pair(max_reqs, torch.int64)  # placeholder rows
        self.fill_src_h, self.fill_src_np, self.fill_src = pair(max_reqs, torch.int64)
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks_per_req

    def copy_to_device(self, num_tokens: int, num_reqs: int, width: int) -> None:
        nb = self.device.type == "cuda"
        self.input_ids[:num_tokens].copy_(self.ids_h[:num_tokens], non_blocking=nb)
        self.positions[:num_tokens].copy_(self.pos_h[:num_tokens], non_blocking=nb)
        self.slot_mapping[:num_tokens].copy_(self.slot_h[:num_tokens], non_blocking=nb)
        self.query_start_loc[:num_reqs + 1].copy_(self.qsl_h[:num_reqs + 1], non_blocking=nb)
        self.seq_lens[:num_reqs].copy_(self.sl_h[:num_reqs], non_blocking=nb)
        n = num_reqs * width
        self.bt_flat[:n].copy_(self.bt_flat_h[:n], non_blocking=nb)
        self.block_tables[:num_reqs, :width].copy_(self.bt_flat[:n].view(num_reqs, width))

    def copy_fills(self, k: int) -> None:
        nb = self.device.type == "cuda"
        self.fill_dst[:k].copy_(self.fill_dst_h[:k], non_blocking=nb)
        self.fill_src[:k].copy_(self.fill_src_h[:k], non_blocking=nb)

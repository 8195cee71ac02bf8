"""The runner's own batch state and its persistent input buffers.

`RequestState` is what the runner knows of a request, built from the scheduler's deltas (kestrel/core/step.py):
tokens, sampling parameters and block ids per KV-cache group. `InputBuffers` holds host-side numpy staging
(pinned on CUDA) and device tensors of fixed capacity, so a step writes into the same memory every time (no
per-step allocation; CUDA graphs replay from it). Each KV-cache group has its own block table and slot mapping;
`GroupTable` owns that paged layout (slot = block * block_size + offset)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel.core.multimodal import MMFeature
from kestrel.core.step import PLACEHOLDER, NewRequestData, TokenSequence
from kestrel.engine.sampling_params import SamplingParams


@dataclass
class RequestState(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # PLACEHOLDER where a launched step's token is not collected yet
    sampling_params: SamplingParams
    min_tokens_stop_ids: list[int]
    block_ids: list[list[int]]  # per KV-cache group
    lora_id: int = 0  # 0: no adapter
    mm_features: list[MMFeature] = field(default_factory=list)
    bidirectional_len: int = 0
    # encoder cache: image index -> its embeddings, kept from the step that first needs them until the step that
    # computes its last placeholder (chunked prefill across an image runs the encoder once)
    encoder_outputs: dict = field(default_factory=dict)

    @classmethod
    def from_new(cls, r: NewRequestData) -> "RequestState":
        return cls(r.request_id, r.prompt_token_ids, list(r.output_token_ids), r.sampling_params,
                   r.min_tokens_stop_ids, [list(ids) for ids in r.block_ids], r.lora_id, list(r.mm_features),
                   r.bidirectional_len)


def _pair(shape, dtype, device, pin):
    host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
    return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)


class GroupTable:
    """One KV-cache group's block table and slot mapping (staging + device)."""

    def __init__(self, block_size: int, max_tokens: int, max_reqs: int, max_blocks_per_req: int,
                 device: torch.device, pin: bool):
        self.block_size = block_size
        self.slot_h, self.slot_np, self.slot_mapping = _pair(max_tokens, torch.int64, device, pin)
        self.block_tables = torch.zeros((max_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        # Block tables are staged compactly ([num_reqs, width] row-major, width = this step's widest request) so
        # that the host->device copy is one contiguous range; a device-side copy then spreads the rows out.
        # (A strided host slice would go through a pageable temporary: a synchronous copy that waits for the
        # step in flight.)
        self.bt_flat_h, self.bt_flat_np, self.bt_flat = _pair(max_reqs * max_blocks_per_req, torch.int32, device, pin)

    def stage_decode(self, t: int, blocks: list[int], pos: int) -> None:
        bs = self.block_size
        self.slot_np[t] = blocks[pos // bs] * bs + pos % bs

    def stage_chunk(self, t: int, blocks: list[int], positions: np.ndarray) -> None:
        bs = self.block_size
        self.slot_np[t:t + len(positions)] = np.asarray(blocks, dtype=np.int64)[positions // bs] * bs + positions % bs

    def stage_row(self, b: int, width: int, blocks: list[int]) -> None:
        self.bt_flat_np[b * width:b * width + len(blocks)] = blocks

    def copy_to_device(self, num_tokens: int, num_reqs: int, width: int, non_blocking: bool) -> None:
        self.slot_mapping[:num_tokens].copy_(self.slot_h[:num_tokens], non_blocking=non_blocking)
        n = num_reqs * width
        self.bt_flat[:n].copy_(self.bt_flat_h[:n], non_blocking=non_blocking)
        self.block_tables[:num_reqs, :width].copy_(self.bt_flat[:n].view(num_reqs, width))


class InputBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, device: torch.device,
                 block_size: int, num_groups: int = 1):
        self.device = device
        pin = device.type == "cuda"
        self.ids_h, self.ids_np, self.input_ids = _pair(max_tokens, torch.int64, device, pin)
        self.pos_h, self.pos_np, self.positions = _pair(max_tokens, torch.int64, device, pin)
        self.qsl_h, self.qsl_np, self.query_start_loc = _pair(max_reqs + 1, torch.int32, device, pin)
        self.sl_h, self.sl_np, self.seq_lens = _pair(max_reqs, torch.int32, device, pin)
        self.groups = [GroupTable(block_size, max_tokens, max_reqs, max_blocks_per_req, device, pin)
                       for _ in range(num_groups)]
        self.fill_dst_h, self.fill_dst_np, self.fill_dst = _pair(max_reqs, torch.int64, device, pin)  # placeholder rows
        self.fill_src_h, self.fill_src_np, self.fill_src = _pair(max_reqs, torch.int64, device, pin)
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks_per_req

    def copy_to_device(self, num_tokens: int, num_reqs: int, width: int) -> None:
        nb = self.device.type == "cuda"
        self.input_ids[:num_tokens].copy_(self.ids_h[:num_tokens], non_blocking=nb)
        self.positions[:num_tokens].copy_(self.pos_h[:num_tokens], non_blocking=nb)
        self.query_start_loc[:num_reqs + 1].copy_(self.qsl_h[:num_reqs + 1], non_blocking=nb)
        self.seq_lens[:num_reqs].copy_(self.sl_h[:num_reqs], non_blocking=nb)
        for g in self.groups:
            g.copy_to_device(num_tokens, num_reqs, width, nb)

    def copy_fills(self, k: int) -> None:
        nb = self.device.type == "cuda"
        self.fill_dst[:k].copy_(self.fill_dst_h[:k], non_blocking=nb)
        self.fill_src[:k].copy_(self.fill_src_h[:k], non_blocking=nb)


__all__ = ["PLACEHOLDER", "GroupTable", "InputBuffers", "RequestState"]

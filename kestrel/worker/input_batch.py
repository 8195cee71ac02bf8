"""The runner's own batch state and its persistent input buffers.

`RequestState` is what the runner knows of a request, built from the scheduler's deltas (kestrel/core/step.py):
tokens and sampling parameters; its block ids per KV-cache group are a row of `BlockTableRows`, written only
when the deltas add blocks. `InputBuffers` holds host-side numpy staging (pinned on CUDA) and device tensors of
fixed capacity, so a step writes into the same memory every time (no per-step allocation; CUDA graphs replay
from it). Each KV-cache group has its own block table and slot mapping (slot = block * block_size + offset);
all groups' are staged together, gathered from the rows in one numpy pass, and copied in one transfer each.
`positions` is what the model's rotary reads: [max_tokens] token indices, or [rows, max_tokens] for a model whose
position scheme has several rows (M-RoPE; kestrel/core/positions.py); the slots always follow the token index
(`pos_np`). Readers slice it as positions[..., :n]."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kestrel.core.extras import NO_EXTRAS, RequestExtras
from kestrel.core.positions import stage_rows
from kestrel.core.step import PLACEHOLDER, NewRequestData, ScheduledChunk, TokenSequence
from kestrel.core.sampling_params import SamplingParams


@dataclass
class RequestState(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # PLACEHOLDER where a launched step's token is not collected yet
    sampling_params: SamplingParams
    min_tokens_stop_ids: list[int]
    extras: RequestExtras = NO_EXTRAS  # the request's features (the runner's add-ons read them)
    table_row: int = -1  # its row of the runner's BlockTableRows
    prompt_positions: np.ndarray | None = None  # [rows, T] where the prompt's positions are not its indices
    rope_delta: int = 0  # added to the index of every token past them

    @classmethod
    def from_new(cls, r: NewRequestData, table_row: int) -> "RequestState":
        p = r.extras.positions
        return cls(r.request_id, r.prompt_token_ids, list(r.output_token_ids), r.sampling_params,
                   r.min_tokens_stop_ids, r.extras, table_row=table_row,
                   prompt_positions=None if p is None else p.array(), rope_delta=0 if p is None else p.delta)


class BlockTableRows:
    """Every live request's block ids: a row [groups, max_blocks] (int32) per request and each group's count,
    written when a request arrives and when the scheduler's deltas add blocks (not every step)."""

    def __init__(self, num_groups: int, max_blocks: int, rows: int):
        self.ids = np.zeros((rows, num_groups, max_blocks), dtype=np.int32)
        self.lens = np.zeros((rows, num_groups), dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))

    def add(self, block_ids: list[list[int]]) -> int:
        """A row for a new request holding `block_ids` (per group); returns the row."""
        if not self._free:  # more live requests than max_num_seqs (not expected): grow
            n = len(self.ids)
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        self.lens[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, new_ids: list[list[int]]) -> None:
        lens = self.lens[row]
        for g, ids in enumerate(new_ids):
            if ids:
                start = lens[g]
                if start + len(ids) > self.ids.shape[2]:
                    raise RuntimeError(f"{start + len(ids)} blocks exceed the {self.ids.shape[2]} of the longest "
                                       "sequence (max_model_len)")
                self.ids[row, g, start:start + len(ids)] = ids
                lens[g] = start + len(ids)

    def free(self, row: int) -> None:
        self._free.append(row)


def _pair(shape, dtype, device, pin):
    host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
    return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)


class InputBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, device: torch.device,
                 block_size: int, num_groups: int = 1, position_rows: int = 1):
        self.device = device
        pin = device.type == "cuda"
        self.ids_h, self.ids_np, self.input_ids = _pair(max_tokens, torch.int64, device, pin)
        self.pos_h, self.pos_np, self.positions = _pair(max_tokens, torch.int64, device, pin)
        self.position_rows = position_rows
        if position_rows > 1:  # staged compactly as [rows, num_tokens] (one contiguous copy), as the slots are
            self.rows_h, self.rows_np, self.rows_flat = _pair(position_rows * max_tokens, torch.int64, device, pin)
            self.positions = torch.zeros((position_rows, max_tokens), dtype=torch.int64, device=device)
        self.qsl_h, self.qsl_np, self.query_start_loc = _pair(max_reqs + 1, torch.int32, device, pin)
        self.sl_h, self.sl_np, self.seq_lens = _pair(max_reqs, torch.int32, device, pin)
        # Per group g: block_tables[g] [max_reqs, max_blocks] and slot_mapping[g] [max_tokens] on the device. A
        # step stages them compactly ([groups, num_reqs, width] and [groups, num_tokens], row-major) so that each
        # host->device copy is one contiguous range; a device-side copy then spreads the rows out. (A strided host
        # slice would go through a pageable temporary: a synchronous copy that waits for the step in flight.)
        self.num_groups, self.block_size = num_groups, block_size
        self.slot_h, self.slot_np, self.slot_flat = _pair(num_groups * max_tokens, torch.int64, device, pin)
        self.slot_mapping = torch.zeros((num_groups, max_tokens), dtype=torch.int64, device=device)
        self.bt_h, self.bt_np, self.bt_flat = _pair(num_groups * max_reqs * max_blocks_per_req, torch.int32, device,
                                                    pin)
        self.block_tables = torch.zeros((num_groups, max_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        self.fill_dst_h, self.fill_dst_np, self.fill_dst = _pair(max_reqs, torch.int64, device, pin)  # placeholder rows
        self.fill_src_h, self.fill_src_np, self.fill_src = _pair(max_reqs, torch.int64, device, pin)
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks_per_req

    def stage_tokens(self, chunks: list[ScheduledChunk], states: list[RequestState], prev_rows: dict | None):
        """Token ids, positions, query starts and sequence lengths of a step (batch order, decodes first) into the
        host staging. A decode row's input token may be sampled by the step in flight (a placeholder, or not
        there yet where that step samples after this one's inputs are staged): it is copied on the device before
        the forward, from row `prev_rows[request id]` of that step's tokens (staged in fill_dst/fill_src).
        Returns (num_tokens, num_decodes, num_fills)."""
        qsl, sl, ids, pos = self.qsl_np, self.sl_np, self.ids_np, self.pos_np
        k = t = num_decodes = 0
        qsl[0] = 0
        for b, (c, st) in enumerate(zip(chunks, states)):
            start, n = c.num_computed_tokens, c.num_new_tokens
            if n == 1:
                tok = st.token_at(start) if start < st.num_prompt_tokens + len(st.output_token_ids) else PLACEHOLDER
                if tok == PLACEHOLDER:
                    self.fill_dst_np[k], self.fill_src_np[k] = t, prev_rows[c.request_id]
                    k += 1
                    tok = 0
                ids[t] = tok
                pos[t] = start
                if num_decodes == b:
                    num_decodes += 1
            else:
                known = n - len(c.draft_token_ids)  # drafts (speculative decoding) follow the known tokens
                ids[t:t + known] = st.tokens_slice(start, start + known)
                ids[t + known:t + n] = c.draft_token_ids
                pos[t:t + n] = np.arange(start, start + n)
            t += n
            qsl[b + 1] = t
            sl[b] = start + n
        if self.position_rows > 1:
            self._stage_rows(chunks, states, t)
        return t, num_decodes, k

    def _stage_rows(self, chunks: list[ScheduledChunk], states: list[RequestState], num_tokens: int) -> None:
        """Every token's position rows: its index + its request's delta (one vectorised pass: decode rows), then
        the prompt's own rows where a chunk reaches into them."""
        rows = self.staged_rows(num_tokens)
        counts = [c.num_new_tokens for c in chunks]
        rows[:] = self.pos_np[:num_tokens] + np.repeat([st.rope_delta for st in states], counts)
        t = 0
        for c, st, n in zip(chunks, states, counts):
            p = st.prompt_positions
            if p is not None and c.num_computed_tokens < p.shape[1]:
                stage_rows(rows[:, t:t + n], p, st.rope_delta, c.num_computed_tokens)
            t += n

    def staged_rows(self, num_tokens: int) -> np.ndarray:
        """[rows, num_tokens] host staging of this step's position rows (a scheme of several rows)."""
        return self.rows_np[:self.position_rows * num_tokens].reshape(self.position_rows, num_tokens)

    def index_positions(self, num_tokens: int) -> None:
        """Every position row of the first tokens is its staged index (dummy batches: profiling, warm-up)."""
        if self.position_rows > 1:
            self.staged_rows(num_tokens)[:] = self.pos_np[:num_tokens]

    def staged_slots(self, num_tokens: int) -> np.ndarray:
        """[groups, num_tokens] host staging of this step's slot mappings."""
        return self.slot_np[:self.num_groups * num_tokens].reshape(self.num_groups, num_tokens)

    def staged_block_tables(self, num_reqs: int, width: int) -> np.ndarray:
        """[groups, num_reqs, width] host staging of this step's block tables."""
        return self.bt_np[:self.num_groups * num_reqs * width].reshape(self.num_groups, num_reqs, width)

    def stage_block_tables(self, rows: BlockTableRows, req_rows: np.ndarray, width: int) -> np.ndarray:
        """Every group's block table of the requests at `req_rows` (batch order), `width` blocks wide."""
        tables = self.staged_block_tables(len(req_rows), width)
        np.copyto(tables, rows.ids[req_rows, :, :width].transpose(1, 0, 2))
        return tables

    def stage_slots(self, tables: np.ndarray, query_start_loc: np.ndarray, positions: np.ndarray) -> None:
        """Every group's slot of every token, from the staged `tables` (token_slots)."""
        token_slots(tables, query_start_loc, positions, self.block_size, out=self.staged_slots(len(positions)))

    def copy_to_device(self, num_tokens: int, num_reqs: int, width: int) -> None:
        nb = self.device.type == "cuda"
        self.input_ids[:num_tokens].copy_(self.ids_h[:num_tokens], non_blocking=nb)
        if self.position_rows > 1:
            n = self.position_rows * num_tokens
            self.rows_flat[:n].copy_(self.rows_h[:n], non_blocking=nb)
            self.positions[:, :num_tokens].copy_(self.rows_flat[:n].view(self.position_rows, num_tokens))
        else:
            self.positions[:num_tokens].copy_(self.pos_h[:num_tokens], non_blocking=nb)
        self.query_start_loc[:num_reqs + 1].copy_(self.qsl_h[:num_reqs + 1], non_blocking=nb)
        self.seq_lens[:num_reqs].copy_(self.sl_h[:num_reqs], non_blocking=nb)
        g, n = self.num_groups, num_tokens * self.num_groups
        self.slot_flat[:n].copy_(self.slot_h[:n], non_blocking=nb)
        self.slot_mapping[:, :num_tokens].copy_(self.slot_flat[:n].view(g, num_tokens))
        n = g * num_reqs * width
        self.bt_flat[:n].copy_(self.bt_h[:n], non_blocking=nb)
        self.block_tables[:, :num_reqs, :width].copy_(self.bt_flat[:n].view(g, num_reqs, width))

    def copy_fills(self, k: int) -> None:
        nb = self.device.type == "cuda"
        self.fill_dst[:k].copy_(self.fill_dst_h[:k], non_blocking=nb)
        self.fill_src[:k].copy_(self.fill_src_h[:k], non_blocking=nb)


def token_slots(tables: np.ndarray, query_start_loc: np.ndarray, positions: np.ndarray, block_size: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """The cache slot of every token: its request's block (`tables` [..., requests, blocks]; any leading dims,
    e.g. groups) at its position. Into `out` (int64, [..., tokens]) where given."""
    req_of_token = np.repeat(np.arange(len(query_start_loc) - 1), np.diff(query_start_loc))
    if out is None:
        out = np.empty(tables.shape[:-2] + (len(positions),), dtype=np.int64)
    out[...] = tables[..., req_of_token, positions // block_size]
    out *= block_size
    out += positions % block_size
    return out


__all__ = ["PLACEHOLDER", "BlockTableRows", "InputBuffers", "RequestState", "token_slots"]

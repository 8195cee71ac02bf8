"""The KV cache of a runner draft layer (EAGLE-3: kestrel/spec_decode/eagle3_drafter.py), and the attention metadata of
one draft forward over it.

The seam (vLLM's idea): the draft's attention layer is a kestrel Attention registered in the target's ModelContext
(as one of its draft_layers) before the layers are bound (kestrel/worker/attention_binding.py), which puts it on
the target's full-attention KV group as one more layer (core/kv_spec.py attach_riders): the group's block table
and slots, so position p of request r lives in the same slot for the draft layer as for the target's layers, and
a page of its own (its KV heads and head size may differ from the target's). The pool sizes it (one more cache
slot in bytes_per_block, so the memory profile counts it), and prefix caching, preemption and freeing move its
entries with the target's: nothing in the scheduler or the KV managers knows it is there. (Grouping the draft
layer by its spec instead would give it a block table of its own, and where its spec differs, cut every other
group to one layer: core/kv_spec.py group_layers.)

What keeps it valid:
- The drafter runs its layer over every position the target computes (prefill chunks, decodes, verified
  positions), so a block holds the draft's K/V wherever it holds the target's: a prefix-cache hit (blocks an
  earlier request wrote), a chunked prefill and a recompute after preemption need nothing more. One inexactness
  remains, by design: the draft's input at position p is token p+1, so the K/V at a hit's last position came from
  the writer's next token. Where two prompts part exactly at a block boundary that one position is stale (a
  shared block cannot hold two requests' values); drafts over it are slightly worse, never wrong. Likewise a
  request preempted while steps pipeline (above disable_by_batch_size) leaves its last step's positions
  unwritten: the runner forgets it before that step is collected, and its blocks are no longer its own to write.
- Chained drafts write positions past the verified ones; the next step recomputes them from the target's hidden
  states before any later query reads them (positions repeat after a rejection). The scheduler allocates
  `k - 1` slots of lookahead for them (SpeculativeConfig.num_lookahead_slots); a draft never writes a slot of a
  block its request does not hold (`owns`): a chain stops there instead.

A draft step's first forward (every position the target computed) is a flattened batch like a target step's
(decode rows first, a request's new tokens at positions seq_len - q_len .. seq_len - 1), its metadata built here by
the group's own builder from the runner's block table rows; it runs eagerly (its shape follows the step's
accepted counts). The chained one-token forwards after it run from static buffers (kestrel/spec_decode/draft_chain.py).
"""
from __future__ import annotations

import numpy as np
import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.layer import Attention, ForwardContext
from kestrel.core.device import to_device
from kestrel.worker.input_batch import token_slots


class DraftKV:
    """Builds the ForwardContext of a draft forward for the draft `layer` (bound: its group_id set), from the
    group's metadata `builder` and the runner's BlockTableRows."""

    def __init__(self, layer: Attention, builder, block_rows, device):
        self.layer, self.builder, self.block_rows, self.device = layer, builder, block_rows, device
        self.block_size = builder.block_size

    def owns(self, table_row: int, position: int) -> bool:
        """Whether the request at `table_row` holds the block of `position` (in the draft's group)."""
        return position // self.block_size < self.block_rows.lens[table_row, self.layer.group_id]

    def context(self, table_rows: list[int], starts: list[int], counts: list[int]) -> tuple[ForwardContext,
                                                                                             torch.Tensor]:
        """A forward of counts[b] new tokens at positions starts[b].. for each request (rows with one token
        first; every position in a block its request holds). Returns (the forward context, positions [T])."""
        bs, gid = self.block_size, self.layer.group_id
        starts_np, counts_np = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(counts_np)])
        seq_lens = starts_np + counts_np
        req_of_token = np.repeat(np.arange(len(counts)), counts_np)
        positions = np.arange(qsl[-1]) - qsl[req_of_token] + starts_np[req_of_token]
        width = int(-(-seq_lens.max() // bs))
        tables = self.block_rows.ids[np.asarray(table_rows), gid, :width]
        slots = token_slots(tables, qsl, positions, bs)
        num_decodes = int(np.argmax(counts_np != 1)) if (counts_np != 1).any() else len(counts)
        common = CommonAttentionMetadata(int(qsl[-1]), len(counts), num_decodes, int(counts_np.max()),
                                         int(seq_lens.max()), to_device(qsl, torch.int32, self.device),
                                         to_device(seq_lens, torch.int32, self.device), qsl.tolist(),
                                         seq_lens.tolist())
        meta = self.builder.build(common, to_device(tables, torch.int32, self.device),
                                  to_device(slots, torch.int64, self.device))
        return ForwardContext([None] * gid + [meta]), to_device(positions, torch.int64, self.device)

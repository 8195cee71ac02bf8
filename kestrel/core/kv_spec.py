"""What each attention-like layer keeps per token: its KV-cache spec. Layers with equal specs form a group; each
group has its own block table and its own manager (kestrel/engine/kv/) under one coordinator, and the runner
allocates every layer's cache from its spec (kestrel/worker/kv_allocation.py).

A spec knows its block size and what one block of one layer holds (its page): a list of parts, each a dtype and
a per-block shape, laid out one after the other. A layer keeping two kinds of per-token data under one block
table (an MLA latent and its indexer keys) is one spec with two parts. A new kind of cache is a spec class here
(or beside its layer), a manager for it and one line in the engine's spec -> manager table
(kestrel/engine/kv/managers.py): never a special case in the runner, the scheduler or the coordinator."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all cache kinds. `block_size` tokens share a block id; `page_parts` is what one block of one layer
    holds. A kind without per-block data (a per-request state slot) has no parts and a page of 0 bytes."""
    dtype: torch.dtype
    block_size: int = field(default=16, kw_only=True)

    def page_parts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each part of one block's page, in page order."""
        raise NotImplementedError

    def state_parts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each part of one request's state, for a kind that keeps a fixed-size state per
        request (a recurrent state) in `num_state_slots` slots outside the block pool; none for paged kinds."""
        return []

    @property
    def num_state_slots(self) -> int:
        return 0

    @property
    def num_snapshot_slots(self) -> int:
        """Of num_state_slots, the last ones that keep prefix-cache snapshots of a state (not a running request's)."""
        return 0

    @property
    def page_bytes(self) -> int:
        """What one block costs in one layer."""
        return parts_bytes(self.page_parts())

    @property
    def state_bytes(self) -> int:
        """What one state slot costs in one layer."""
        return parts_bytes(self.state_parts())

    def part_views(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each page part as a [num_blocks, *shape] view of `rows`: uint8 [num_blocks, row_bytes], one row per
        block id, whose first page_bytes are this layer's page (a row may be wider: see kv_allocation.py)."""
        return views_of_parts(self.page_parts(), rows, type(self).__name__)

    def layer_view(self, rows: torch.Tensor, state: torch.Tensor | None = None):
        """What the layer's impl receives as its cache: the page parts, or the one part alone. `state` (uint8
        [num_state_slots, state_bytes]) is the layer's state slots, for kinds with state_parts (which override
        this to view them with views_of_parts)."""
        views = self.part_views(rows)
        return views[0] if len(views) == 1 else tuple(views)


def parts_bytes(parts: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in parts)


def views_of_parts(parts: list[tuple[torch.dtype, tuple[int, ...]]], rows: torch.Tensor,
                   what: str = "a spec") -> list[torch.Tensor]:
    """`parts` laid out one after the other in each row of `rows` (uint8 [n, row_bytes]): [n, *shape] views."""
    views, offset = [], 0
    for dtype, shape in parts:
        size = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize or rows.stride(0) % dtype.itemsize:
            raise ValueError(f"part {dtype}{list(shape)} of {what} is not aligned in its row")
        views.append(rows[:, offset:offset + size].view(dtype).view(rows.shape[0], *shape))
        offset += size
    return views


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V for every token, paged: a (k_cache, v_cache) pair per layer, each [num_blocks, block_size,
    num_kv_heads, head_dim] (one block's K and V sit side by side in its page)."""
    num_kv_heads: int = 1
    head_dim: int = 1

    def page_parts(self):
        kv = (self.dtype, (self.block_size, self.num_kv_heads, self.head_dim))
        return [kv, kv]


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged like full attention, but a query at position p reads only keys p - window + 1 .. p: blocks that fall
    out of every future query's window are freed while the request runs."""
    sliding_window: int = 0


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    """Chunked local attention (Llama 4's iRoPE layers): a query at position p reads only the keys of its own
    chunk, floor(p / attention_chunk_size) * attention_chunk_size .. p. Paged like full attention, and its layers
    group apart; the blocks of finished chunks are kept while the request runs (the full-attention manager's
    rule, by its MRO), which freeing them as a sliding window does would save."""
    attention_chunk_size: int = 0


@dataclass(frozen=True)
class SharedKVSpec(KVCacheSpec):
    """A layer that keeps no cache and reads an earlier layer's (`source`, that layer's name: Gemma 4's KV-shared
    layers read the last earlier layer of their type). It takes no pages and forms no group: group_layers puts it
    on the source's group as a reader (`KVCacheGroup.readers`), so it shares the source's block table, metadata and
    cache view. `reads`: the spec it would have had, which must be the source's."""
    source: str = ""
    reads: KVCacheSpec | None = None

    def page_parts(self):
        return []


@dataclass(frozen=True)
class MLASpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one latent per token, the normalised kv_lora_rank part followed
    by the rotated qk_rope_head_dim key part, shared by every head; one [num_blocks, block_size, latent_dim] tensor
    per layer. Prefix caching as for full attention: every block is kept while the request runs."""
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def page_parts(self):
        return [(self.dtype, (self.block_size, self.latent_dim))]


@dataclass(frozen=True)
class SparseMLASpec(MLASpec):
    """MLA with DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): beside each token's latent, its lightning-indexer
    key (index_head_dim values), in the same block: one block table keeps both, so prefix caching, chunking and
    preemption move them together. The layer view is (latent [blocks, bs, latent_dim], index_k [blocks, bs,
    index_head_dim]). A layer that shares another layer's top-k (GLM-5.2 "shared") keeps the index part unused.
    `index_topk` (keys each query attends to) and `layer_dense_prefill` (the layer class's declared
    supports_dense_mha_prefill) are what the metadata builder routes a step by.
    `index_dtype` float8 (--indexer-key-dtype fp8, kestrel/attention/indexer_keys.py): the keys are float8 with a
    float32 scale per token after them, (index_head_dim + 4) bytes a token, and the layer view is (latent,
    (keys [blocks, bs, index_head_dim], scales [blocks, bs, 1])). None: the keys in `dtype`."""
    index_head_dim: int = 128
    index_topk: int = 2048
    layer_dense_prefill: bool = False
    index_dtype: torch.dtype | None = None

    def page_parts(self):
        bs = self.block_size
        if self.index_dtype is None:
            return [*super().page_parts(), (self.dtype, (bs, self.index_head_dim))]
        return [*super().page_parts(), (self.index_dtype, (bs, self.index_head_dim)), (torch.float32, (bs, 1))]

    def layer_view(self, rows, state=None):
        views = self.part_views(rows)
        return (views[0], views[1]) if len(views) == 2 else (views[0], (views[1], views[2]))


@dataclass(frozen=True)
class KDAStateSpec(KVCacheSpec):
    """Kimi Delta Attention (kestrel/layers/kda.py): a fixed-size state per request instead of per-token pages. Per
    layer and slot: the recurrent state, float32 [num_heads, head_dim, head_dim] (key dim x value dim), and the
    short convolution's last conv_width - 1 inputs of q, k and v, `dtype` [3 * num_heads * head_dim,
    conv_width - 1]. `num_slots` is the slot pool, slot 0 (the null slot, read and written by CUDA-graph padding
    rows) included: group_layers stamps max_num_seqs + 1 on it. The request's one table entry is its slot.
    `num_snapshots` more slots follow them: states saved at block boundaries for prefix caching (the slot
    manager's snapshot pool), part of the same allocation and so of the KV budget."""
    num_heads: int = 1
    head_dim: int = 1
    conv_width: int = 4
    num_slots: int = 0
    num_snapshots: int = 0

    def page_parts(self):
        return []

    def state_parts(self):
        h, d = self.num_heads, self.head_dim
        return [(torch.float32, (h, d, d)), (self.dtype, (3 * h * d, self.conv_width - 1))]

    @property
    def num_state_slots(self) -> int:
        return self.num_slots + self.num_snapshots

    @property
    def num_snapshot_slots(self) -> int:
        return self.num_snapshots

    def layer_view(self, rows, state=None):
        """(recurrent [num_slots, H, D, D] float32, conv [num_slots, 3 H D, conv_width - 1])."""
        return tuple(views_of_parts(self.state_parts(), state, type(self).__name__))


@dataclass(frozen=True)
class GDNStateSpec(KDAStateSpec):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5; kestrel/kernels/kda_ref.py DeltaOptions): KDA's state slots with
    num_key_heads q/k heads (fewer than the num_heads state heads) and values of value_head_dim. Per slot: the
    recurrent state float32 [num_heads, head_dim, value_head_dim] and the convolution's last conv_width - 1
    inputs of q | k | v, [2 * num_key_heads * head_dim + num_heads * value_head_dim, conv_width - 1]."""
    num_key_heads: int = 1
    value_head_dim: int = 1

    def state_parts(self):
        h, dk, dv = self.num_heads, self.head_dim, self.value_head_dim
        return [(torch.float32, (h, dk, dv)), (self.dtype, (2 * self.num_key_heads * dk + h * dv, self.conv_width - 1))]


@dataclass
class KVCacheGroup:
    """Layers (by name) sharing one spec, one block table and one manager. Layer i of every group shares cache
    slot i (kestrel/worker/kv_allocation.py): one block id is then a page in every group, and all groups draw on
    one pool. `layer_specs`: layers that ride on the group's block table with a page of their own (a draft model's
    attention: attach_riders); `readers`: layers that read one of the group's layers' cache (reader -> source:
    SharedKVSpec), bound to its view and metadata, with no slot of their own. Both the runner's alone (the
    engine's managers read `spec`)."""
    group_id: int
    spec: KVCacheSpec
    layer_names: list[str]
    layer_specs: dict[str, KVCacheSpec] = field(default_factory=dict)
    readers: dict[str, str] = field(default_factory=dict)

    def spec_of(self, name: str) -> KVCacheSpec:
        """The spec of one of the group's layers (its page)."""
        return self.layer_specs.get(name, self.spec)


def group_layers(specs: dict[str, KVCacheSpec], block_size: int | None = None,
                 max_num_seqs: int | None = None, num_snapshots: int = 0) -> list[KVCacheGroup]:
    """Group layers by spec, in model order (`block_size`, when given, is stamped on every spec: the configured
    one). With several specs, each spec's layers are cut into groups of the smallest spec's layer count, so every
    group has (at most) the same number of layers: Gemma 3's 4 full and 22 sliding layers become 1 + 6 groups of
    4 layers that share 4 cache slots. Specs may differ in page size: a slot's rows are as wide as its widest.
    Kinds with a per-request state (state_parts) take no pages: all layers of one such spec form one group, and
    `max_num_seqs`, when given, sizes their slot pools (their `num_slots` field: one per request + the null slot),
    and `num_snapshots` their snapshot slots (prefix caching: 0 keeps none). A SharedKVSpec layer joins its source's
    group as a reader."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    readers = {name: spec for name, spec in specs.items() if isinstance(spec, SharedKVSpec)}
    for name, spec in specs.items():
        if name in readers:
            continue
        if block_size is not None:
            spec = replace(spec, block_size=block_size)
        if max_num_seqs is not None and spec.state_parts():
            spec = replace(spec, num_slots=max_num_seqs + 1, num_snapshots=num_snapshots)
        by_spec.setdefault(spec, []).append(name)
    sizes = {s.block_size for s in by_spec}
    if len(sizes) > 1:
        raise ValueError(f"KV-cache specs with different block sizes in one model: {sorted(sizes)}")
    paged = [len(v) for s, v in by_spec.items() if not s.state_parts()]
    size = min(paged) if paged else None
    groups: list[KVCacheGroup] = []
    for spec, names in by_spec.items():
        step = len(names) if spec.state_parts() or size is None else size
        for i in range(0, len(names), step):
            groups.append(KVCacheGroup(len(groups), spec, names[i:i + step]))
    for name, spec in readers.items():
        source = next((g for g in groups if spec.source in g.layer_names), None)
        if source is None:
            raise ValueError(f"{name} reads the KV cache of {spec.source!r}, which keeps none of its own")
        if replace(spec.reads, block_size=source.spec.block_size, dtype=source.spec.dtype) != source.spec:
            raise ValueError(f"{name} reads {spec.source}'s cache with another shape: {spec.reads} against "
                             f"{source.spec}")
        source.readers[name] = spec.source
    return groups


def attach_riders(groups: list[KVCacheGroup], riders: dict[str, KVCacheSpec]) -> KVCacheGroup | None:
    """Put each rider (a draft model's full-attention layer: name -> its spec) on the first group of the model's
    full-attention layers, as one more layer of it: the group's block table and slots (position p of a request
    in the same slot as for the model's layers), its own page (its spec may have other heads; the block size
    becomes the group's). Grouping ignores riders, so a draft never cuts the model's groups. Returns that group
    (None: no rider, or no full-attention group to ride on)."""
    host = next((g for g in groups if type(g.spec) is FullAttentionSpec), None)
    if not riders or host is None:
        return None
    for name, spec in riders.items():
        host.layer_names.append(name)
        host.layer_specs[name] = replace(spec, block_size=host.spec.block_size)
    return host

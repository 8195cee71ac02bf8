"""KV-cache memory with different page sizes in one pool: a block id is a row of every cache slot, as wide as
the slot's widest page; each layer views its page's parts. Layers sharing a slot (different groups) never hold
the same block id at once, so writing distinct values through every layer's views for the blocks its group
owns, then reading them all back, finds every value intact."""
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kestrel.core.kv_spec import FullAttentionSpec, KVCacheSpec, MLASpec, group_layers, views_of_parts
from kestrel.worker.kv_allocation import allocate_kv_cache, bytes_per_block, slot_row_bytes, state_bytes

BS = 4


@dataclass(frozen=True)
class LatentWithKeySpec(KVCacheSpec):
    """Three parts under one block table, as sparse MLA keeps its latent, its indexer keys and their scales."""
    latent_dim: int = 12
    key_dim: int = 8

    def page_parts(self):
        return [(self.dtype, (self.block_size, self.latent_dim)), (torch.uint8, (self.block_size, self.key_dim)),
                (torch.float32, (self.block_size, 1))]


FULL = FullAttentionSpec(torch.float32, 2, 8, block_size=BS)  # 2 x 4 x 2 x 8 x 4 = 512 bytes a block
LATENT = MLASpec(torch.bfloat16, 16, 8, block_size=BS)  # 4 x 24 x 2 = 192 bytes
INDEXED = LatentWithKeySpec(torch.bfloat16, block_size=BS)  # 4 x 12 x 2 + 4 x 8 + 4 x 4 = 144 bytes


def build(num_blocks):
    specs = {"f0": FULL, "m0": LATENT, "f1": FULL, "i0": INDEXED, "m1": LATENT, "f2": FULL, "i1": INDEXED}
    groups = group_layers(specs)
    layers = {name: SimpleNamespace(kv_cache=None) for name in specs}
    return groups, layers, allocate_kv_cache(groups, layers, num_blocks, torch.device("cpu"))


def test_page_sizes_and_slot_rows():
    assert (FULL.page_bytes, LATENT.page_bytes, INDEXED.page_bytes) == (512, 192, 144)
    groups, _, slots = build(num_blocks=6)
    # groups of 2 layers: full [f0, f1], [f2]; latent [m0, m1]; indexed [i0, i1]
    assert [g.layer_names for g in groups] == [["f0", "f1"], ["f2"], ["m0", "m1"], ["i0", "i1"]]
    assert slot_row_bytes(groups) == [512, 512] and bytes_per_block(groups) == 1024
    assert [tuple(s.shape) for s in slots] == [(6, 512), (6, 512)]
    only_small = group_layers({"m0": LATENT, "i0": INDEXED})
    assert slot_row_bytes(only_small) == [192]  # a row is as wide as its slot's widest page, no wider


def test_views_of_different_layers_never_overlap():
    num_blocks = 8
    groups, layers, _ = build(num_blocks)
    owner = {b: b % len(groups) for b in range(num_blocks)}  # each block id held by one group at a time

    def parts(name):
        cache = layers[name].kv_cache
        return list(cache) if isinstance(cache, tuple) else [cache]

    shapes = {name: [tuple(p.shape) for p in parts(name)] for name in layers}
    assert shapes["f0"] == [(num_blocks, BS, 2, 8)] * 2 and shapes["m0"] == [(num_blocks, BS, 24)]
    assert shapes["i0"] == [(num_blocks, BS, 12), (num_blocks, BS, 8), (num_blocks, BS, 1)]

    def value(layer, part, block):
        return (7 * layer + 3 * part + block) % 61 + 1

    names = list(layers)
    for write in (True, False):
        for g in groups:
            for name in g.layer_names:
                for j, p in enumerate(parts(name)):
                    for b in (b for b in range(num_blocks) if owner[b] == g.group_id):
                        v = value(names.index(name), j, b)
                        if write:
                            p[b].fill_(v)
                        else:
                            assert (p[b] == v).all(), (name, j, b)


def test_reference_cache_writers_honour_a_wider_row():
    """A page narrower than its slot's rows gives views whose block stride is the row: the reference K/V and
    latent writers index (block, offset) and land where the kernels read, leaving the other blocks alone."""
    from kestrel.attention.backends.torch_mla import write_latent_ref
    from kestrel.attention.ops.reference import reshape_and_cache_ref

    wide = FullAttentionSpec(torch.float32, 2, 32, block_size=BS)  # 2048-byte rows
    groups = group_layers({"w": wide, "f": FULL, "m": LATENT})
    layers = {name: SimpleNamespace(kv_cache=None) for name in ("w", "f", "m")}
    allocate_kv_cache(groups, layers, 5, torch.device("cpu"))
    k_cache, v_cache = layers["f"].kv_cache
    assert k_cache.stride(0) == 2048 // 4  # the row, not the page
    slots = torch.tensor([6, 13, -1])  # block 1 offset 2, block 3 offset 1, padding
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 2], key[0]) and torch.equal(v_cache[3, 1], value[1])
    assert int((k_cache != 0).sum() + (v_cache != 0).sum()) == 4 * 16  # nothing else written
    latent = layers["m"].kv_cache  # the same slot (another group): blocks 0 and 4, which "f" does not hold
    kv_c, k_pe = torch.randn(2, 16), torch.randn(2, 8)
    write_latent_ref(kv_c, k_pe, latent, torch.tensor([2, 17]))
    assert torch.equal(latent[0, 2], torch.cat([kv_c[0], k_pe[0]]).bfloat16())
    assert torch.equal(latent[4, 1], torch.cat([kv_c[1], k_pe[1]]).bfloat16())
    assert int((latent[[0, 4]] != 0).sum()) == 2 * 24
    assert torch.equal(k_cache[1, 2], key[0]) and torch.equal(v_cache[3, 1], value[1])  # still there


@dataclass(frozen=True)
class RecurrentStateSpec(KVCacheSpec):
    """Test-only: a per-request state (a heads x dim x dim matrix and a short convolution state) in slots of its
    own, no pages: the shape of a linear-attention layer's cache."""
    heads: int = 2
    dim: int = 4
    slots: int = 3

    def page_parts(self):
        return []

    def state_parts(self):
        return [(torch.float32, (self.heads, self.dim, self.dim)), (torch.bfloat16, (3, self.heads * self.dim))]

    @property
    def num_state_slots(self):
        return self.slots

    def layer_view(self, rows, state=None):
        return tuple(views_of_parts(self.state_parts(), state))


def test_state_slots_are_allocated_beside_the_pool():
    state_spec = RecurrentStateSpec(torch.float32, block_size=BS)
    assert (state_spec.page_bytes, state_spec.state_bytes) == (0, 2 * 4 * 4 * 4 + 3 * 8 * 2)
    groups = group_layers({"a0": FULL, "s0": state_spec, "s1": state_spec, "a1": FULL})
    assert slot_row_bytes(groups) == [512, 512]  # the attention layers alone: state adds no bytes to a block
    assert state_bytes(groups) == 2 * 3 * 176
    layers = {name: SimpleNamespace(kv_cache=None) for name in ("a0", "s0", "s1", "a1")}
    tensors = allocate_kv_cache(groups, layers, 4, torch.device("cpu"))
    assert [tuple(t.shape) for t in tensors] == [(4, 512), (4, 512), (3, 176), (3, 176)]
    (m0, c0), (m1, c1) = layers["s0"].kv_cache, layers["s1"].kv_cache
    assert tuple(m0.shape) == (3, 2, 4, 4) and tuple(c0.shape) == (3, 3, 8) and c0.dtype == torch.bfloat16
    m0.fill_(1.0)
    c0.fill_(2.0)
    assert not m1.any() and not c1.any() and (m0 == 1).all()  # each layer's state is its own

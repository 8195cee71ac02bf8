"""The disk KV tier under the host tier (--kv-offloading-disk-path, --kv-offloading-disk-size): files named by
block hash in a folder of the model and cache layout's fingerprint, written through in the background, checked on
every read. A restarted engine serves an evicted prompt's prefix from disk (cached tokens reported, the same
greedy tokens); a corrupt or truncated file is dropped with one log line and its blocks recomputed, never wrong
tokens; the size bound holds; /reset_prefix_cache removes the files."""
import logging
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig
from kestrel.core.kv_connector import ROWS, KVConnectorMeta
from kestrel.core.sampling_params import SamplingParams as SP
from kestrel.engine.addons.kv_offload import KVOffload
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.kv.disk_tier import DiskTierConnector
from kestrel.engine.kv.host_tier import HostTierConnector
from kestrel.engine.kv.pool import hash_block
from kestrel.engine.request import Request
from kestrel.errors import ConfigError
from kestrel.worker.kv_disk_tier import HEADER, DiskTierWorker, entry_key, entry_name, file_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
A = [(7 * i + 3) % 90 + 5 for i in range(40)]  # 2 full blocks of 16 before the last token
OTHERS = [[(11 * i + 13 * j + 1) % 90 + 5 for i in range(60)] for j in range(1, 4)]


def engine(model, disk, **kw):
    return LLM(str(model), progress=False, num_kv_blocks=8, max_model_len=128, kv_offloading_size=0.001,
               kv_offloading_disk_path=str(disk), kv_offloading_disk_size=0.01, **kw)


def flushed(llm):
    llm.engine.core.executor.runner.kv_connector.wait_for_save()
    return llm


def files(llm):
    return sorted(p for p in llm.engine.core.kv_offload.connector.lower.directory.iterdir())


def a_and_others(llm):
    first = llm.generate([A], GREEDY)[0]
    for p in OTHERS:  # A's device blocks are reallocated: saved to the host and written to disk
        llm.generate([p], GREEDY)
    return first


def a_files(llm):
    """A's two full blocks' files, in prompt order."""
    hashes, parent = [], None
    for i in range(2):
        parent = hash_block(parent, A[16 * i:16 * (i + 1)])
        hashes.append(parent)
    directory = llm.engine.core.kv_offload.connector.lower.directory
    return [directory / entry_name((0, h)) for h in hashes]


def test_a_restarted_engine_serves_the_prefix_from_disk(tiny_llama, tmp_path):
    llm = flushed(engine(tiny_llama, tmp_path))
    first = a_and_others(llm)
    flushed(llm)
    assert all(p.exists() for p in a_files(llm))
    assert all(p.stat().st_size == file_bytes(llm.engine.core.kv_offload.connector.lower.entry_bytes[ROWS])
               for p in files(llm))
    again = flushed(engine(tiny_llama, tmp_path))  # a fresh engine: empty device and host, the same folder
    disk = again.engine.core.kv_offload.connector.lower
    assert disk.directory == llm.engine.core.kv_offload.connector.lower.directory and len(disk.files) >= 2
    out = again.generate([A], GREEDY)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    stats = again.engine.core.get_stats()
    assert stats["disk_kv_read_blocks"] == 2 and stats["tier_kv_hits"] == 32 and stats["kv_transfer_failures"] == 0


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "missing"])
def test_a_damaged_file_is_dropped_and_recomputed(tiny_llama, tmp_path, caplog, damage):
    llm = engine(tiny_llama, tmp_path)
    first = a_and_others(llm)
    flushed(llm)
    good, bad = a_files(llm)
    again = engine(tiny_llama, tmp_path)  # its scan lists both files; then the second is damaged
    assert entry_key(bad.name) in again.engine.core.kv_offload.connector.lower.files
    data = bytearray(bad.read_bytes())
    if damage == "flipped byte":
        data[HEADER.size + 5] ^= 0xFF
        bad.write_bytes(bytes(data))
    elif damage == "truncated":
        bad.write_bytes(bytes(data[:len(data) // 2]))
    else:
        bad.unlink()
    with caplog.at_level(logging.WARNING, logger="kestrel.worker.kv_disk_tier"):
        out = again.generate([A], GREEDY)[0]
    assert out.outputs[0].token_ids == first.outputs[0].token_ids  # never wrong tokens
    lines = [r for r in caplog.records if r.name == "kestrel.worker.kv_disk_tier"]
    assert len(lines) == 1 and bad.name in lines[0].getMessage()
    assert not bad.exists()  # dropped
    # the good block came back (loaded and registered); the bad one was computed again
    assert out.num_cached_tokens == 16
    core = again.engine.core
    assert core.get_stats()["kv_transfer_failures"] == 1
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert entry_key(bad.name) not in core.kv_offload.connector.lower.files
    # a later return finds A's blocks on the device again
    assert again.generate([A], GREEDY)[0].num_cached_tokens == 32


def test_reset_prefix_cache_removes_the_files(tiny_llama, tmp_path):
    llm = engine(tiny_llama, tmp_path)
    a_and_others(llm)
    flushed(llm)
    assert files(llm)
    llm.engine.core.reset_prefix_cache()
    assert not llm.engine.core.kv_offload.connector.lower.files
    llm.generate([[5, 6, 7]], GREEDY)  # the next step carries the removals
    flushed(llm)
    assert not any(p.exists() for p in a_files(llm))
    assert flushed(engine(tiny_llama, tmp_path)).generate([A], GREEDY)[0].num_cached_tokens == 0


def test_another_layout_reads_another_folder(tiny_llama, tmp_path):
    a = engine(tiny_llama, tmp_path)
    b = engine(tiny_llama, tmp_path, block_size=8)
    da, db = (x.engine.core.kv_offload.connector.lower.directory for x in (a, b))
    assert da != db and da.parent == db.parent == tmp_path


# ---- the two sides alone
def test_the_size_bound_removes_the_least_recently_used_files(tmp_path):
    entry = 100
    disk = DiskTierConnector(tmp_path, 3 * file_bytes(entry), {ROWS: entry}, [ROWS])
    keys = [(0, bytes([i]) * 16) for i in range(5)]
    for i, k in enumerate(keys[:3]):
        disk.on_evict(k, i)
    disk.update_state_after_alloc([keys[0]])  # read: the most recently used now
    disk.update_state_after_alloc([keys[0]], [7])
    disk.on_evict(keys[3], 3)
    meta = disk.build_connector_meta()
    assert meta.removes == [] and [n for _, _, n in meta.writes] == [entry_name(k) for k in (keys[0], keys[2], keys[3])]
    assert meta.reads == [(ROWS, 7, entry_name(keys[0]))]
    assert set(disk.files) == {keys[0], keys[2], keys[3]} and disk.used <= disk.num_bytes
    disk.on_evict(keys[4], 4)  # a file written in an earlier step goes
    assert disk.build_connector_meta().removes == [entry_name(keys[2])]


def test_a_restart_scans_the_folder_oldest_first_within_the_bound(tmp_path):
    worker = DiskTierWorker(tmp_path / ("00" * 16))
    rows = [torch.arange(6, dtype=torch.uint8).reshape(2, 3)]
    keys = [(0, bytes([i]) * 16) for i in range(3)]
    for i, k in enumerate(keys):
        worker.write([(ROWS, i % 2, entry_name(k))], {ROWS: rows}, set())
        worker.wait()
        os.utime(worker.directory / entry_name(k), ns=(10**9 * (i + 1), 10**9 * (i + 1)))
    (worker.directory / "x.kv.tmp").write_bytes(b"half")
    disk = DiskTierConnector(worker.directory, 2 * file_bytes(3), {ROWS: 3}, [ROWS])
    assert list(disk.files) == keys[1:]  # the oldest went over the bound
    assert not (worker.directory / "x.kv.tmp").exists()
    worker.remove(disk.build_connector_meta().removes)
    worker.wait()
    assert sorted(p.name for p in worker.directory.iterdir()) == sorted(entry_name(k) for k in keys[1:])
    dev = [torch.zeros(4, 3, dtype=torch.uint8)]
    assert worker.read([(ROWS, 2, entry_name(keys[2]))], {ROWS: dev}) == []
    assert torch.equal(dev[0][2], rows[0][0])


def test_a_file_of_another_fingerprint_or_key_is_refused(tmp_path, caplog):
    rows = [torch.arange(6, dtype=torch.uint8).reshape(2, 3)]
    mine, other = DiskTierWorker(tmp_path / ("11" * 16)), DiskTierWorker(tmp_path / ("22" * 16))
    key = (0, b"\x01" * 16)
    other.write([(ROWS, 0, entry_name(key))], {ROWS: rows}, set())
    other.wait()
    (mine.directory / entry_name(key)).write_bytes((other.directory / entry_name(key)).read_bytes())
    (mine.directory / entry_name((0, b"\x02" * 16))).write_bytes((other.directory / entry_name(key)).read_bytes())
    dev = [torch.zeros(2, 3, dtype=torch.uint8)]
    with caplog.at_level(logging.WARNING):
        failed = mine.read([(ROWS, 0, entry_name(key)), (ROWS, 1, entry_name((0, b"\x02" * 16)))], {ROWS: dev})
    assert failed == [(ROWS, 0), (ROWS, 1)] and not dev[0].any()
    assert sum("another format, model or key" in r.getMessage() for r in caplog.records) == 2


def test_disk_flags_are_refused_without_their_partners():
    config = EngineConfig()
    config.cache.kv_offloading_disk_path = "/tmp/x"
    with pytest.raises(ConfigError, match="needs --kv-offloading-size"):
        KVOffload.check_config(config)
    config.cache.kv_offloading_size = 1.0
    with pytest.raises(ConfigError, match="needs --kv-offloading-disk-size"):
        KVOffload.check_config(config)
    config.cache.kv_offloading_disk_size = 1.0
    config.parallel.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="tensor-parallel-size > 1 is not supported"):
        KVOffload.check_config(config)
    config.cache.kv_offloading_disk_path, config.parallel.tensor_parallel_size = None, 1
    with pytest.raises(ConfigError, match="needs --kv-offloading-disk-path"):
        KVOffload.check_config(config)


def test_the_step_metadata_with_file_transfers_crosses_the_worker_boundary():
    from kestrel.core.step import StepInput
    from kestrel.executor.messages import encoder, step_decoder
    meta = KVConnectorMeta(saves=[(ROWS, 1, 0)], writes=[(ROWS, 0, "0-ab.kv")], reads=[(2, 9, "2-cd.kv")],
                           removes=["0-ef.kv"])
    assert step_decoder.decode(encoder.encode(StepInput(kv_connector_meta=meta))).kv_connector_meta == meta


def test_state_snapshots_come_back_from_disk_after_a_restart(tmp_path, tiny_tokenizer):
    """Kimi Linear: MLA latent blocks (ROWS) and a KDA state snapshot (its group's unit) as files."""
    from tests.tiny import make_checkpoint
    path = make_checkpoint("kimi_linear", tmp_path / "model", tokenizer=tiny_tokenizer)
    kw = dict(num_state_snapshots=1)
    llm = engine(path, tmp_path / "kv", **kw)
    first = a_and_others(llm)
    flushed(llm)
    units = {u for u, _ in llm.engine.core.kv_offload.connector.lower.entry_bytes.items()}
    assert len(units) == 2 and ROWS in units
    again = engine(path, tmp_path / "kv", **kw)
    out = again.generate([A], GREEDY)[0]
    assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.engine.core.get_stats()["disk_kv_read_blocks"] == 3  # 2 latent blocks + the snapshot


# ---- random schedules through both tiers: what a hit reads is what was computed for its hash


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 14), st.booleans(), st.integers(0, 4)),
                min_size=1, max_size=40), st.integers(1, 6), st.integers(0, 8))
def test_random_schedules_through_host_and_disk_load_what_was_saved(tmp_path_factory, ops, host_blocks, disk_files):
    """Prompts from a few shared prefixes, requests held a while (pressure), a small device pool, a smaller host
    tier and (disk_files > 0) a disk tier under it, the transfers applied in the worker's order (saves, writes of
    the host slots just saved, loads, reads, removals): every block a request holds as a hit contains the block
    its hash names, the files never exceed their bound, and no block or pin leaks."""
    bs, entry = 4, 64
    kv = KVCacheManager(num_blocks=8, block_size=bs)
    disk = None
    if disk_files:
        disk = DiskTierConnector(tmp_path_factory.mktemp("disk"), disk_files * file_bytes(entry), {ROWS: entry},
                                 [ROWS])
    tier = HostTierConnector({ROWS: (host_blocks * entry, entry)}, [ROWS], disk)
    kv.set_connector(tier)
    device, host, files = {}, {}, {}  # block id / host slot / file name -> the key whose contents it holds
    live = []
    stems = [[100 * s + i for i in range(14)] for s in range(6)]

    def transfer():
        meta = kv.build_connector_meta()
        if meta is not None:
            for _, b, s in meta.saves:
                host[s] = device.get(b)
            for _, s, name in meta.writes:
                files[name] = host.get(s)
            for _, b, s in meta.loads:
                device[b] = host.get(s)
            for _, b, name in meta.reads:
                device[b] = files[name]  # a file the index lists exists (its write came first)
            for name in meta.removes:
                del files[name]
            tier.steps_loading -= meta.has_loads
        assert not tier.pools[ROWS].pinned
        if disk is not None:
            assert set(files) == {entry_name(k) for k in disk.files} and disk.used <= disk.num_bytes
            assert all(files[entry_name(k)] == k for k in disk.files)

    for n, (stem, length, hold, reset) in enumerate(ops):
        if reset == 4 and not live:
            kv.reset_prefix_cache()
        r = Request(f"r{n}", stems[stem][:length], SP(max_tokens=4), max_tokens=4)
        computed, hit = kv.get_computed_blocks(r)
        if not kv.allocate_slots(r, r.num_tokens - hit, computed):
            transfer()
            while live:
                kv.free(live.pop(0))
            continue
        transfer()
        hashes, ids = r.block_hashes, kv.block_ids(r)[0]
        for i in range(hit // bs):
            assert device.get(ids[i]) == (0, hashes[i]), (i, ids[i])
        for i in range(hit // bs, len(ids)):
            device[ids[i]] = (0, hashes[i]) if i < len(hashes) else None
        r.num_computed_tokens = r.num_tokens
        kv.cache_full_blocks(r)
        if hold:
            live.append(r)
        else:
            kv.free(r)
        if len(live) > 2:
            kv.free(live.pop(0))
    for r in live:
        kv.free(r)
    transfer()
    assert kv.num_free_blocks == kv.num_blocks and tier.steps_loading == 0
    pool = tier.pools[ROWS]
    assert len(pool) + len(pool.free_slots) == pool.num_slots


def test_the_fingerprint_follows_the_weights_and_the_layout(tmp_path):
    from kestrel.core.kv_spec import FullAttentionSpec, KVCacheGroup
    from kestrel.worker.kv_disk_tier import fingerprint
    model = tmp_path / "m"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    config = EngineConfig()
    config.model.model = str(model)
    groups = [KVCacheGroup(0, FullAttentionSpec(torch.float16, block_size=16, num_kv_heads=2, head_dim=8), ["l0"])]
    base = fingerprint(config, groups)
    assert fingerprint(config, groups) == base  # stable across engines
    os.utime(weights, ns=(1, 1))  # the checkpoint rewritten
    rewritten = fingerprint(config, groups)
    assert rewritten != base
    other = [KVCacheGroup(0, FullAttentionSpec(torch.float16, block_size=16, num_kv_heads=2, head_dim=16), ["l0"])]
    assert fingerprint(config, other) != rewritten
    config.cache.kv_cache_dtype = "fp8"
    assert fingerprint(config, groups) != rewritten


def test_a_read_waits_for_a_queued_write_of_its_file(tmp_path):
    worker = DiskTierWorker(tmp_path / ("33" * 16))
    rows = [torch.arange(6, dtype=torch.uint8).reshape(2, 3)]
    name = entry_name((0, b"\x05" * 16))
    worker.write([(ROWS, 1, name)], {ROWS: rows}, set())
    rows[0].zero_()  # the write copied the slot when queued
    dev = [torch.zeros(1, 3, dtype=torch.uint8)]
    assert worker.read([(ROWS, 0, name)], {ROWS: dev}) == []
    assert dev[0][0].tolist() == [3, 4, 5] and not worker.pending

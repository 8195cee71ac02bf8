"""The disk KV tier's worker side (--kv-offloading-disk-path, under the host tier): one file per prefix entry,
named by its key (group id and block hash: `entry_name`), in a directory named by the model and cache layout's
fingerprint (`tier_directory`), so another model, dtype or layout never reads them. Written in the background
(one thread, in order with the removals) from a copy of the host slot taken at the step; read synchronously into
the device before the step's forward, once no write of the same file is queued. A file is a fixed header (magic, the
fingerprint, the key, the payload's length and its blake2b checksum) then the raw rows of the entry's tensors:
no pickle. A file that is missing, truncated, of another fingerprint or key, or whose checksum fails is dropped
with one log line and reported as a failed load (its readers are computed again). The scheduler side (which keys
are on disk, the size bound, LRU) is kestrel/engine/kv/disk_tier.py."""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import Counter
from pathlib import Path

import torch

from kestrel.core.kv_spec import KVCacheGroup

logger = logging.getLogger(__name__)

MAGIC = b"KSTLKV01"
HEADER = struct.Struct("<8s16sI16sQ16s")  # magic, fingerprint, group id, block hash, payload bytes, checksum
SUFFIX = ".kv"


def entry_name(key: tuple[int, bytes]) -> str:
    return f"{key[0]}-{key[1].hex()}{SUFFIX}"


def entry_key(name: str) -> tuple[int, bytes] | None:
    """The key a file name stands for (None: not an entry's name)."""
    if not name.endswith(SUFFIX) or "-" not in name:
        return None
    group, _, digest = name[:-len(SUFFIX)].partition("-")
    try:
        return int(group), bytes.fromhex(digest)
    except ValueError:
        return None


def file_bytes(entry_bytes: int) -> int:
    return HEADER.size + entry_bytes


def fingerprint(config, groups: list[KVCacheGroup]) -> bytes:
    """What the files' contents depend on: the model (its path, revision and, for a local folder, its weight
    files' names, sizes and modification times), the dtypes, and the cache layout (every group's spec and layers,
    the block size). The block hashes cover the tokens and salts."""
    model = config.model
    path = Path(model.model)
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".pt")) \
        if path.is_dir() else [path] if path.is_file() else []
    weights = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    if path.exists():
        path = path.resolve()
    facts = {"format": 1, "model": str(path), "revision": model.revision, "weights": weights,
             "load_format": model.load_format, "quantization": model.quantization, "dtype": model.dtype,
             "kv_cache_dtype": config.cache.kv_cache_dtype,
             "groups": [[g.group_id, repr(g.spec), g.layer_names, sorted((k, repr(v)) for k, v in g.layer_specs.items())]
                        for g in groups]}
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).digest()


def tier_directory(config, groups: list[KVCacheGroup]) -> Path:
    return Path(config.cache.kv_offloading_disk_path) / fingerprint(config, groups).hex()


class DiskTierWorker:
    def __init__(self, directory: Path):
        self.directory = directory
        self.fingerprint = bytes.fromhex(directory.name)
        directory.mkdir(parents=True, exist_ok=True)
        self.jobs: queue.Queue = queue.Queue()
        self.pending: Counter = Counter()  # file name -> queued writes and removals of it
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self.thread.start()
        atexit.register(self.wait)  # a clean exit writes what is queued (the thread is a daemon)

    # ---- the step's transfers (HostTierWorker.start_load_kv calls these in order)
    def write(self, writes: list[tuple[int, int, str]], host: dict[int, list[torch.Tensor]], failed: set) -> None:
        """Queue host slots for their files; the rows are copied now (the slot may be reused next step). A slot
        whose save failed this step is not written."""
        for unit, slot, name in writes:
            if (unit, slot) not in failed:
                self._queue(name, [t[slot].clone() for t in host[unit]])

    def read(self, reads: list[tuple[int, int, str]], units: dict[int, list[torch.Tensor]]) -> list[tuple[int, int]]:
        """Files into device rows, each checked; returns the (unit, device index) that failed."""
        if not reads:
            return []
        with self.lock:
            queued = any(self.pending[name] for _, _, name in reads)
        if queued:  # a file still being written (or removed and written again): let the queue catch up
            self.wait()
        failed = []
        for unit, index, name in reads:
            tensors = units[unit]
            payload = self._payload(name, sum(t.shape[1] for t in tensors))
            if payload is None:
                failed.append((unit, index))
                continue
            offset = 0
            for t in tensors:
                n = t.shape[1]
                if n:  # a slot no layer of the group pages into is 0 bytes wide
                    t[index] = torch.frombuffer(payload, dtype=torch.uint8, offset=offset, count=n).to(t.device)
                offset += n
        return failed

    def remove(self, names: list[str]) -> None:
        for name in names:
            self._queue(name, None)

    def _queue(self, name: str, rows: list[torch.Tensor] | None) -> None:
        with self.lock:
            self.pending[name] += 1
        self.jobs.put((name, rows))

    def wait(self) -> None:
        """Until every queued write and removal is done."""
        self.jobs.join()

    # ---- files
    def _payload(self, name: str, size: int) -> bytearray | None:
        path = self.directory / name
        key = entry_key(name)
        try:
            data = path.read_bytes()
        except OSError as e:
            logger.warning("KV disk tier: %s unreadable (%s); recomputed", name, e)
            return None
        why = None
        if len(data) != HEADER.size + size:
            why = f"{len(data)} bytes, not {HEADER.size + size}"
        else:
            magic, fp, group, digest, length, checksum = HEADER.unpack_from(data)
            payload = memoryview(data)[HEADER.size:]
            if magic != MAGIC or fp != self.fingerprint or (group, digest) != key or length != size:
                why = "another format, model or key"
            elif hashlib.blake2b(payload, digest_size=16).digest() != checksum:
                why = "checksum mismatch"
        if why is not None:
            logger.warning("KV disk tier: %s is corrupt (%s); dropped and recomputed", name, why)
            path.unlink(missing_ok=True)
            return None
        return bytearray(payload)

    def _run(self) -> None:
        while True:
            name, rows = self.jobs.get()
            try:
                if rows is None:
                    (self.directory / name).unlink(missing_ok=True)
                else:
                    self._write(name, rows)
            except OSError as e:
                logger.warning("KV disk tier: writing %s failed (%s)", name, e)
            finally:
                with self.lock:
                    self.pending[name] -= 1
                    if not self.pending[name]:
                        del self.pending[name]
                self.jobs.task_done()

    def _write(self, name: str, rows: list[torch.Tensor]) -> None:
        payload = b"".join(r.numpy().tobytes() for r in rows)
        group, digest = entry_key(name)
        header = HEADER.pack(MAGIC, self.fingerprint, group, digest, len(payload),
                             hashlib.blake2b(payload, digest_size=16).digest())
        tmp = self.directory / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, self.directory / name)  # a reader never sees a half-written file under the name

"""The disk KV tier (--kv-offloading-disk-path DIR, --kv-offloading-disk-size GiB), scheduler side: the second
KV connector (kestrel/core/kv_connector.py), under the host tier (host_tier.py). It keeps which prefix entries have
a file (one per key, in the directory of the model and cache layout's fingerprint: kestrel/worker/
kv_disk_tier.py), least recently used first, never more file bytes than the bound.

- Save: every entry the host tier saves is written through to disk (`on_evict(key, host slot)`: the worker
  writes the slot's copy in the background), so the disk holds what the host held, and more; a restarted engine
  finds the files (`scan`, oldest first) and serves their prefixes.
- Load: a lookup that misses on the device and the host but finds a file has the worker read it straight into
  the device block (or snapshot slot) before the step's forward, checked (length, fingerprint, key, checksum).
- Over the bound, the least recently used files are removed (by the worker, in order with its writes)."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from kestrel.core.kv_connector import KVConnector, KVConnectorMeta
from kestrel.worker.kv_disk_tier import SUFFIX, entry_key, entry_name, file_bytes


class DiskTierConnector(KVConnector):
    """`entry_bytes`: unit -> bytes of one entry; `unit_of`: each group's unit."""

    def __init__(self, directory: Path, num_bytes: int, entry_bytes: dict[int, int], unit_of):
        self.directory, self.num_bytes = directory, num_bytes
        self.entry_bytes, self.unit_of = entry_bytes, unit_of
        self.files: OrderedDict[tuple[int, bytes], int] = OrderedDict()  # key -> file bytes; head: removed first
        self.used = 0
        self.meta = KVConnectorMeta()
        self._loading: list[tuple[int, bytes]] = []
        self.written_blocks = self.read_blocks = self.read_bytes = self.written_bytes = 0
        directory.mkdir(parents=True, exist_ok=True)
        self.scan()

    def scan(self) -> None:
        """The files a previous engine left (oldest first); leftovers of interrupted writes are removed."""
        found = []
        for path in self.directory.iterdir():
            key = entry_key(path.name)
            if key is None or key[0] >= len(self.unit_of) or self.unit_of[key[0]] not in self.entry_bytes:
                if path.name.endswith(SUFFIX + ".tmp"):
                    path.unlink(missing_ok=True)
                continue
            st = path.stat()
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.files[key] = size
            self.used += size
        self._bound()

    def _bound(self) -> None:
        while self.used > self.num_bytes and self.files:
            key, size = self.files.popitem(last=False)
            self.used -= size
            self._remove(entry_name(key))

    def _remove(self, name: str) -> None:
        """A removal, in order with this step's writes: one of the same file this step is cancelled instead."""
        for i, (_, _, n) in enumerate(self.meta.writes):
            if n == name:
                del self.meta.writes[i]
                return
        self.meta.removes.append(name)

    def contains(self, key) -> bool:
        return key in self.files

    def update_state_after_alloc(self, keys, targets=None) -> None:
        if targets is None:
            self._loading = list(keys)
            for k in keys:
                self.files.move_to_end(k)
            return
        for key, index in zip(self._loading, targets):
            unit = self.unit_of[key[0]]
            self.meta.reads.append((unit, index, entry_name(key)))
            self.read_blocks += 1
            self.read_bytes += self.entry_bytes[unit]
        self._loading = []

    def on_evict(self, key, index: int) -> None:
        """The host tier saved `key` into its slot `index`: write it through."""
        if key in self.files:
            self.files.move_to_end(key)
            return
        unit = self.unit_of[key[0]]
        size = file_bytes(self.entry_bytes[unit])
        if size > self.num_bytes:
            return
        name = entry_name(key)
        if name in self.meta.removes:  # removed earlier this step: the write replaces the file
            self.meta.removes.remove(name)
        self.files[key] = size
        self.used += size
        self.meta.writes.append((unit, index, name))
        self.written_blocks += 1
        self.written_bytes += self.entry_bytes[unit]
        self._bound()

    def build_connector_meta(self) -> KVConnectorMeta | None:
        meta, self.meta = self.meta, KVConnectorMeta()
        return meta or None

    def discard(self, key) -> None:
        size = self.files.pop(key, None)
        if size is not None:
            self.used -= size
            self._remove(entry_name(key))

    def reset(self) -> None:
        """Every file goes (removed by the worker before anything written later)."""
        for key in list(self.files):
            self.discard(key)

    def stats(self) -> dict:
        return {"disk_kv_blocks": len(self.files), "disk_kv_bytes": self.used,
                "disk_kv_written_blocks": self.written_blocks, "disk_kv_read_blocks": self.read_blocks,
                "disk_kv_written_bytes": self.written_bytes, "disk_kv_read_bytes": self.read_bytes}

"""The host-memory KV tier (--kv-offloading-size GiB, --kv-offloading-backend native), an engine add-on: it puts
the host tier's connector (kestrel/engine/kv/host_tier.py, the interface in kestrel/core/kv_connector.py) behind
the KV coordinator's prefix cache; the runner holds the memory and makes the copies (kestrel/worker/
kv_host_tier.py). Every cache kind the prefix cache covers goes through it: each manager declares its unit
(KVManager.tier_unit: a paged block's rows, or a state group's snapshot) and the byte bound is shared among the
units as the device shares its KV memory (kestrel/worker/kv_host_tier.py tier_units).

With --kv-offloading-disk-path, a disk tier (kestrel/engine/kv/disk_tier.py, worker side kestrel/worker/
kv_disk_tier.py) sits under the host tier: the second KV connector, composed under the first.

Preemption by offload: the scheduler preempts as ever (KVCacheManager.preempt), and this add-on decides what the
tier does with the request's computed full blocks (`preempted`, the coordinator's on_preempt): where they cover at
least --kv-offloading-preempt-min-tokens tokens (the config's help gives the cost model: a copy's bytes against
the prefill tokens it saves, and the pipelining bubble of a step that loads) and the host can hold them, they are
copied to the host tier at once and held there until the request runs again, and its prefix lookup then loads
them (or takes them from the device, if still there); otherwise the host saves none of them and the request is
recomputed as without a tier. Paged blocks only: a recurrent state group resumes from its last prefix snapshot.

A step whose transfers failed (a copy raising, a corrupt file) never yields wrong tokens: a step with loads is
collected before the next is scheduled (no pipelining over it), and once collected, the failed entries leave the
prefix cache and the tiers, and the requests that read them drop the step's tokens and are computed again."""
from __future__ import annotations

import logging

from kestrel.core.engine_addon import EngineAddon
from kestrel.engine.kv.disk_tier import DiskTierConnector
from kestrel.engine.kv.host_tier import HostTierConnector
from kestrel.errors import ConfigError
from kestrel.worker.kv_disk_tier import file_bytes, tier_directory
from kestrel.worker.kv_host_tier import GiB, host_tier_bytes, tier_units

logger = logging.getLogger(__name__)

BACKENDS = ("native",)


class KVOffload(EngineAddon):
    name = "kv_offload"

    def __init__(self, connector: HostTierConnector, core):
        self.connector = connector
        self.core = core
        self.failures = 0
        self.preempt_min_tokens = core.config.cache.kv_offloading_preempt_min_tokens
        self.preempted_ids: set[str] = set()  # preempted requests whose holds or skips last until they run again
        self.preempt_offloads = self.preempt_recomputes = 0
        core.kv.on_preempt = self.preempted

    @classmethod
    def check_config(cls, config) -> None:
        cache = config.cache
        if cache.kv_offloading_backend not in BACKENDS:
            raise ConfigError(f"--kv-offloading-backend {cache.kv_offloading_backend}: only {', '.join(BACKENDS)}")
        if cache.kv_offloading_size is None:
            if cache.kv_offloading_disk_path or cache.kv_offloading_disk_size is not None:
                raise ConfigError("--kv-offloading-disk-path/--kv-offloading-disk-size: the disk KV tier sits under "
                                  "the host tier, which needs --kv-offloading-size")
            return
        if cache.kv_offloading_disk_path:
            if cache.kv_offloading_disk_size is None or cache.kv_offloading_disk_size <= 0:
                raise ConfigError("--kv-offloading-disk-path needs --kv-offloading-disk-size, a positive number of "
                                  f"GiB (not {cache.kv_offloading_disk_size})")
            if config.parallel.tensor_parallel_size > 1:
                raise ConfigError("--kv-offloading-disk-path with --tensor-parallel-size > 1 is not supported (the "
                                  "disk tier reads and checks its files on one rank)")
        elif cache.kv_offloading_disk_size is not None:
            raise ConfigError("--kv-offloading-disk-size needs --kv-offloading-disk-path (the directory)")
        if cache.kv_offloading_size <= 0:
            raise ConfigError(f"--kv-offloading-size must be a positive number of GiB, not {cache.kv_offloading_size}")
        if not cache.enable_prefix_caching:
            raise ConfigError("--kv-offloading-size needs prefix caching (the host tier sits behind it): drop "
                              "--no-enable-prefix-caching")

    @classmethod
    def build(cls, core) -> "KVOffload | None":
        size = core.config.cache.kv_offloading_size
        if size is None:
            return None
        if not core.kv.enable_prefix_caching:
            raise ConfigError("--kv-offloading-size needs prefix caching, which is off for this model")
        groups, kv = core.executor.kv_cache_groups, core.kv
        units = tier_units(groups, len(kv.pool.blocks), host_tier_bytes(size, core.config.parallel.tensor_parallel_size))
        unit_of = [m.tier_unit for m in kv.managers]
        connector = HostTierConnector(units, unit_of, cls._disk_tier(core.config, groups, units, unit_of),
                                      save_on_free=core.config.cache.kv_offloading_save == "free")
        empty = [f"{e} bytes" for u, (_, e) in units.items() if not connector.pools[u].num_slots]
        if empty:
            raise ConfigError(f"--kv-offloading-size {size} GiB holds no KV-cache entry of {', '.join(empty)}")
        kv.set_connector(connector)
        logger.info("Host KV tier: %d entries (%.2f GiB) behind the prefix cache", connector.num_slots,
                    connector.num_bytes / 2**30)
        return cls(connector, core)

    @staticmethod
    def _disk_tier(config, groups, units, unit_of) -> DiskTierConnector | None:
        cache = config.cache
        if not cache.kv_offloading_disk_path:
            return None
        entry = {u: e for u, (_, e) in units.items()}
        limit = int(cache.kv_offloading_disk_size * GiB)
        if file_bytes(max(entry.values())) > limit:
            raise ConfigError(f"--kv-offloading-disk-size {cache.kv_offloading_disk_size} GiB holds no KV-cache "
                              f"file of {file_bytes(max(entry.values()))} bytes")
        disk = DiskTierConnector(tier_directory(config, groups), limit, entry, unit_of)
        logger.info("Disk KV tier under the host tier: %s (%d files, %.2f of %.2f GiB)", disk.directory,
                    len(disk.files), disk.used / GiB, limit / GiB)
        return disk

    def preempted(self, req, entries: list) -> None:
        """The scheduler preempts `req`; `entries`: (key, block id) of its computed full paged blocks."""
        rid = req.request_id
        self.connector.release(rid)  # preempted again before it ran
        tokens = req.num_computed_tokens // self.core.kv.block_size * self.core.kv.block_size
        if (tokens >= self.preempt_min_tokens and req.sampling_params.prompt_logprobs is None
                and self.connector.hold(rid, entries)):
            self.preempt_offloads += 1
        else:
            self.connector.skip(rid, [key for key, _ in entries])
            self.preempt_recomputes += 1
        self.preempted_ids.add(rid)

    def allows_pipelining(self) -> bool:
        """Not over a step with loads: its failures are handled before the next step is scheduled."""
        return not self.connector.steps_loading

    def after_collect(self, sched, result, pending) -> None:
        if self.preempted_ids:  # a preempted request that ran again (its loads are done) or ended: holds end
            requests, ran = self.core.scheduler.requests, {s.request.request_id for s in sched.scheduled}
            for rid in [r for r in self.preempted_ids if r in ran or r not in requests]:
                self.preempted_ids.discard(rid)
                self.connector.release(rid)
        meta = sched.step.kv_connector_meta
        if meta is not None and meta.has_loads:
            self.connector.steps_loading -= 1
        failures = result.kv_failures
        if not failures:
            return
        self.failures += len(failures.loads) + len(failures.saves)
        self.core.kv.drop_failed_transfers(failures)
        scheduler = self.core.scheduler
        for rid in failures.requests:
            for outputs in (result.sampled, result.logprobs, result.prompt_logprobs, result.more_sampled,
                            result.more_logprobs):
                outputs.pop(rid, None)
            req = scheduler.requests.get(rid)
            if req is not None and not req.is_finished:
                scheduler.recompute(req)

    def stats(self, stats) -> None:
        for name, value in self.connector.stats().items():
            setattr(stats, name, value)
        stats.tier_kv_queries, stats.tier_kv_hits = self.core.kv.tier_queries, self.core.kv.tier_hits
        stats.kv_transfer_failures = self.failures
        stats.host_kv_preempt_offloads, stats.host_kv_preempt_recomputes = self.preempt_offloads, self.preempt_recomputes

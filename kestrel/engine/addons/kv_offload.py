"""The host-memory KV tier (--kv-offloading-size GiB, --kv-offloading-backend native), an engine add-on: it puts
the host tier's connector (kestrel/engine/kv/host_tier.py, the interface in kestrel/core/kv_connector.py) behind
the KV coordinator's prefix cache; the runner holds the memory and makes the copies (kestrel/worker/
kv_host_tier.py). Every cache kind the prefix cache covers goes through it: each manager declares its unit
(KVManager.tier_unit: a paged block's rows, or a state group's snapshot) and the byte bound is shared among the
units as the device shares its KV memory (kestrel/worker/kv_host_tier.py tier_units)."""
from __future__ import annotations

import logging

from kestrel.core.engine_addon import EngineAddon
from kestrel.engine.kv.host_tier import HostTierConnector
from kestrel.errors import ConfigError
from kestrel.worker.kv_host_tier import host_tier_bytes, tier_units

logger = logging.getLogger(__name__)

BACKENDS = ("native",)


class KVOffload(EngineAddon):
    name = "kv_offload"

    def __init__(self, connector: HostTierConnector):
        self.connector = connector

    @classmethod
    def check_config(cls, config) -> None:
        cache = config.cache
        if cache.kv_offloading_backend not in BACKENDS:
            raise ConfigError(f"--kv-offloading-backend {cache.kv_offloading_backend}: only {', '.join(BACKENDS)}")
        if cache.kv_offloading_size is None:
            return
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
        connector = HostTierConnector(units, [m.tier_unit for m in kv.managers])
        empty = [f"{e} bytes" for u, (_, e) in units.items() if not connector.pools[u].num_slots]
        if empty:
            raise ConfigError(f"--kv-offloading-size {size} GiB holds no KV-cache entry of {', '.join(empty)}")
        kv.set_connector(connector)
        logger.info("Host KV tier: %d entries (%.2f GiB) behind the prefix cache", connector.num_slots,
                    connector.num_bytes / 2**30)
        return cls(connector)

    def stats(self, stats) -> None:
        for name, value in self.connector.stats().items():
            setattr(stats, name, value)

"""The host-memory KV tier (--kv-offloading-size GiB, --kv-offloading-backend native), an engine add-on: it puts
the host tier's connector (kestrel/engine/kv/host_tier.py, the interface in kestrel/core/kv_connector.py) behind
the KV coordinator's prefix cache; the runner holds the memory and makes the copies (kestrel/worker/
kv_host_tier.py). Full-attention groups only for now: a model with other cache kinds is refused, naming them."""
from __future__ import annotations

import logging

from kestrel.core.engine_addon import EngineAddon
from kestrel.core.kv_spec import FullAttentionSpec
from kestrel.engine.kv.host_tier import HostTierConnector
from kestrel.errors import ConfigError
from kestrel.worker.kv_allocation import bytes_per_block
from kestrel.worker.kv_host_tier import host_tier_bytes

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
        groups = core.executor.kv_cache_groups
        others = sorted({type(g.spec).__name__ for g in groups if type(g.spec) is not FullAttentionSpec})
        if others:
            raise ConfigError(f"--kv-offloading-size covers full-attention layers only; this model's KV cache also "
                              f"has {', '.join(others)} layers (not supported by the host KV tier yet)")
        if not core.kv.enable_prefix_caching:
            raise ConfigError("--kv-offloading-size needs prefix caching, which is off for this model")
        block_bytes = bytes_per_block(groups)
        connector = HostTierConnector(host_tier_bytes(size, core.config.parallel.tensor_parallel_size), block_bytes)
        if connector.pool.num_slots == 0:
            raise ConfigError(f"--kv-offloading-size {size} GiB holds no KV block of {block_bytes} bytes")
        core.kv.set_connector(connector)
        logger.info("Host KV tier: %d blocks (%.2f GiB) behind the prefix cache", connector.pool.num_slots,
                    connector.pool.num_bytes / 2**30)
        return cls(connector)

    def stats(self, stats) -> None:
        for name, value in self.connector.stats().items():
            setattr(stats, name, value)

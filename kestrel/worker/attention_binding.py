"""Binds the model's attention layers to backends: the layers grouped by cache spec (the configured KV-cache and
indexer-key dtypes applied), a draft model's attention layers riding on the full-attention group
(core/kv_spec.py attach_riders), one backend per group that has what the add-ons' features require, each layer
(and each reader of a layer's cache) given its backend's impl (and its FP8 scales) and its group id."""
from __future__ import annotations

import torch

from kestrel.attention import kv_quant
from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.layer import ForwardContext
from kestrel.attention.indexer_keys import specs_with_index_key_dtype
from kestrel.attention.selector import select_attention_backend
from kestrel.config import EngineConfig
from kestrel.core.kv_spec import KVCacheGroup, attach_riders, group_layers
from kestrel.errors import ConfigError
from kestrel.platform import current_platform


def bind_attention(context, config: EngineConfig, addons: list, dtype: torch.dtype,
                   device: torch.device) -> tuple[list[KVCacheGroup], list, list]:
    """`context`: the loaded model's (attention_layers, kv_cache_specs). Returns the KV-cache groups, their
    backends and their metadata builders, in group order."""
    specs = kv_quant.specs_with_cache_dtype(context.kv_cache_specs, config.cache.kv_cache_dtype)
    specs = specs_with_index_key_dtype(specs, config.cache.indexer_key_dtype)
    cache, max_seqs, block_size = config.cache, config.scheduler.max_num_seqs, config.cache.block_size
    snapshots = (max_seqs if cache.num_state_snapshots is None else cache.num_state_snapshots
                 ) if cache.enable_prefix_caching else 0
    riders = {name: specs[name] for name in context.draft_layers}
    groups = group_layers({name: s for name, s in specs.items() if name not in riders}, block_size, max_seqs,
                          snapshots)
    if riders and attach_riders(groups, riders) is None:
        kinds = ", ".join(sorted({type(g.spec).__name__ for g in groups}))
        raise ConfigError(f"speculative_config: the draft's attention keeps its KV cache beside the target's "
                          f"full-attention layers, and the target has none (its caches: {kinds}); use method "
                          f"'ngram' or start without speculative_config")
    backends, builders = [], []
    requires = tuple(sorted({flag for a in addons for flag in a.backend_requires}))
    for g in groups:
        what = f"KV group {g.group_id} ({type(g.spec).__name__}, {len(g.layer_names)} layers)"
        # what the group's layers declare they need of the backend (attention sinks: gpt-oss)
        sinks = any(getattr(context.attention_layers[n], "sinks", None) is not None for n in g.layer_names)
        backend = select_attention_backend(g.spec, block_size, config.kernel.attention_backend, what=what,
                                           requires=requires + (("supports_attention_sinks",) if sinks else ()),
                                           dtype=dtype)
        backends.append(backend)
        builders.append(backend.builder_cls(g.spec, g.spec.block_size, device))
        for name in [*g.layer_names, *g.readers]:
            layer = context.attention_layers[name]
            if name in g.layer_specs:  # a rider: its head size must suit the group's backend too
                ok, why = backend.validate(current_platform(), dtype, layer.head_dim, block_size)
                if not ok:
                    raise ConfigError(f"speculative_config: the draft's attention cannot run on the target's "
                                      f"attention backend {backend.name}: {why}")
            extra = {"sinks": layer.sinks} if getattr(layer, "sinks", None) is not None else {}
            layer.impl = backend.impl_cls(layer.num_heads, layer.head_dim, layer.scale, layer.num_kv_heads,
                                          sliding_window=layer.sliding_window,
                                          logits_soft_cap=layer.logits_soft_cap,
                                          attention_chunk_size=layer.attention_chunk_size, **extra)
            if kv_quant.is_fp8(g.spec.dtype):  # a reader reads with its source's scales
                owner = context.attention_layers[g.readers.get(name, name)]
                layer.impl.k_scale, layer.impl.v_scale = owner.k_scale, owner.v_scale
            layer.group_id = g.group_id
    return groups, backends, builders


def max_step_tokens(config) -> int:
    """The most tokens of one step's forward (the persistent buffers' size)."""
    sc = config.scheduler
    return max(sc.max_num_batched_tokens, sc.max_num_seqs)


def step_metadata(builders, buf, num_tokens: int, num_reqs: int, num_decodes: int, max_query_len: int,
                  max_seq_len: int, width: int, qsl_cpu=None, sl_cpu=None, capture: bool = False,
                  **fields) -> ForwardContext:
    """Every group's attention metadata over the first rows of the input buffers `buf`, from its backend's
    builder. `fields`: the add-ons' extra common fields (attention_fields)."""
    common = CommonAttentionMetadata(num_tokens, num_reqs, num_decodes, max_query_len, max_seq_len,
                                     buf.query_start_loc[:num_reqs + 1], buf.seq_lens[:num_reqs], qsl_cpu, sl_cpu,
                                     **fields)
    metas = []
    for g, builder in enumerate(builders):
        build = builder.build_for_capture if capture else builder.build
        metas.append(build(common, buf.block_tables[g, :num_reqs, :width], buf.slot_mapping[g, :num_tokens]))
    return ForwardContext(metas)

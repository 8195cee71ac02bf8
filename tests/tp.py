"""Shared by the tensor-parallel tests (tests/engine/test_tensor_parallel.py, test_ray_executor.py and the server's
worker-death test): the checkpoints, the mixed-length prompts, an engine at a given TP size and greedy decoding."""
from __future__ import annotations

import torch

from kestrel.config import EngineConfig
from kestrel.frontend.sync_engine import LLMEngine
from kestrel.core.sampling_params import SamplingParams

NUM_TOKENS = 32

# name -> (tests/tiny.py kind, overrides). llama_linear_rope: one KV head for 2 ranks (replicated), untied LM head;
# qwen3 with vocab 387 (odd: the vocab-parallel embedding and LM head pad their slices); qwen3_moe: every expert
# split along its intermediate dim; qwen2_moe: shared experts (a column/row-parallel MLP) with their sigmoid gate,
# a dense layer, tied embeddings (the vocab-parallel LM head shares the embedding's slice); minimax_m2: the q/k
# RMSNorm over all heads (its sum of squares all-reduced, each rank's slice of the weight), random norm weights;
# minimax_m2_mqa: its one KV head replicated on both ranks (counted once in k's norm); gemma4_moe: per-layer head
# shapes (the global layers' one KV head replicated), K = V, the MoE block's experts split; gemma4_kv_shared: the
# per-layer inputs (replicated), layers reading other layers' caches on each rank; glm4: the checkpoint's fused
# gate_up_proj, each rank reading its rows of both halves
TP_MODELS = {
    "llama": ("llama_linear_rope", {}),
    "qwen3": ("qwen3", {"vocab_size": 387}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {"tie_word_embeddings": True}),
    "minimax_m2": ("minimax_m2", {"vary_vectors": True}),
    "minimax_m2_mqa": ("minimax_m2", {"vary_vectors": True, "num_key_value_heads": 1}),
    "gemma4_moe": ("gemma4_moe", {}),
    "gemma4_kv_shared": ("gemma4_kv_shared", {}),
    "glm4": ("glm4", {"vary_vectors": True}),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 64)]


def engine(path, tp: int, **kw) -> LLMEngine:
    cfg = EngineConfig.create(model=str(path), dtype="float32", tensor_parallel_size=tp, max_num_seqs=8,
                              kv_cache_memory=4 * 2**20, **kw)
    return LLMEngine(cfg, progress=False)


def greedy(eng: LLMEngine, prompt_ids: list[list[int]], n: int = NUM_TOKENS) -> list[list[int]]:
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompt_ids]
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return [list(out[i]) for i in ids]

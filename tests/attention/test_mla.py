"""The absorbed MLA path (latent-space MQA, W_UK folded into the query, W_UV into the output) equals the expanded
path (per-head K/V from kv_b_proj, dense attention) on the same inputs, CPU float32, relative error norm < 1e-5,
for contexts up to 32k tokens and the block sizes in use; the builder routes by the backend's declaration."""
import pytest
import torch

from kestrel.attention.backends.torch_mla import TorchMLAAbsorbedBackend, TorchMLABackend
from kestrel.attention.selector import select_attention_backend
from kestrel.core.kv_spec import MLASpec
from kestrel.bench.mla_inputs import make_batch, make_layer, rel_err, run_backend
from kestrel.engine.kv import FullAttentionManager, manager_class

# decodes first (one query token), then prefill chunks over cached prefixes
REQS = [(1, 1), (1, 777), (1, 32768), (1, 4100), (5, 300), (3, 3)]


@pytest.mark.parametrize("block_size", [16, 64])
def test_absorbed_equals_expanded(block_size):
    layer = make_layer()
    batch = make_batch(layer, REQS, block_size, torch.float32, "cpu")
    absorbed, meta_a = run_backend(TorchMLAAbsorbedBackend, layer, batch, block_size)
    expanded, meta_e = run_backend(TorchMLABackend, layer, batch, block_size, as_decode=False)
    assert meta_a.num_absorbed_reqs == len(REQS) and meta_e.num_absorbed_reqs == 0
    assert rel_err(absorbed, expanded) < 1e-5
    for b, (q0, q1) in enumerate(zip(meta_a.query_start_loc_cpu, meta_a.query_start_loc_cpu[1:])):
        assert rel_err(absorbed[q0:q1], expanded[q0:q1]) < 1e-5, f"request {b} ({REQS[b]})"


def test_builder_routes_by_declared_capability():
    layer = make_layer()
    batch = make_batch(layer, REQS, 16, torch.float32, "cpu")
    mixed, meta = run_backend(TorchMLABackend, layer, batch, 16)
    assert (meta.num_absorbed_reqs, meta.num_absorbed_tokens) == (4, 4)  # decodes absorbed, chunks dense
    assert meta.dense_ctx_start_cpu == [0, 300, 303]
    assert meta.dense_query_start_loc.tolist() == [0, 5, 8]  # the dense part's own, built once a step
    assert (meta.dense_max_query_len, meta.dense_max_seq_len) == (5, 300)
    absorbed, meta = run_backend(TorchMLAAbsorbedBackend, layer, batch, 16)
    assert meta.num_absorbed_reqs == len(REQS) and meta.dense_ctx_slots is None
    assert rel_err(mixed, absorbed) < 1e-5


def test_mla_spec_and_selection():
    spec = MLASpec(torch.bfloat16, 512, 64, block_size=16)
    assert spec.page_bytes == 16 * 576 * 2  # vs Llama-8B's 2 * 8 * 128 * 2 = 4096 bytes a token a layer
    assert spec.layer_view(torch.zeros(10, spec.page_bytes, dtype=torch.uint8)).shape == (10, 16, 576)
    assert manager_class(spec) is FullAttentionManager  # prefix caching as full attention
    assert select_attention_backend(MLASpec(torch.float32, 32, 8), 16) is TorchMLABackend
    assert select_attention_backend(MLASpec(torch.float32, 32, 8), 16, "torch_mla_absorbed") is TorchMLAAbsorbedBackend

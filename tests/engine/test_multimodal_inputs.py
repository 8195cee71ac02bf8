"""Image inputs without a model: tensors over the wire (raw bytes + dtype + shape, msgspec), block hashes keyed by
image content and by a bidirectional prefix, the bidirectional mask of the reference attention, and backend
selection for layers that need it."""
from __future__ import annotations

import msgspec
import pytest
import torch

from kestrel.attention.backend import AttentionBackend
from kestrel.attention.backends.torch_ref import TorchRefBackend
from kestrel.attention.ops.reference import paged_attention_ref
from kestrel.attention.selector import select_attention_backend
from kestrel.core.extras import RequestExtras
from kestrel.core.kv_spec import FullAttentionSpec
from kestrel.errors import ConfigError, InvalidRequest
from kestrel.worker.addons.prefix_mask import BidirectionalPrefix
from kestrel.core.multimodal import MMFeature, TensorData, hash_tensors
from kestrel.engine.kv import KVCacheManager
from kestrel.ipc.protocol import EngineCoreRequest, add_decoder, encoder
from kestrel.engine.request import Request
from kestrel.core.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensor_roundtrip_over_msgspec(dtype):
    t = (torch.randn(2, 3, 5) * 100).to(dtype)
    feat = MMFeature(4, 7, hash_tensors({"pixel_values": t}), {"pixel_values": TensorData.from_tensor(t)})
    req = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), 4, 0.0,
                            extras=RequestExtras(lora_id=2, mm_features=[feat], bidirectional_len=3))
    back = add_decoder.decode(encoder.encode(req)).extras
    got = back.mm_features[0].data["pixel_values"].to_tensor()
    assert got.dtype == dtype and torch.equal(got, t)
    feature = back.mm_features[0]
    assert (feature.offset, feature.length, back.bidirectional_len, back.lora_id) == (4, 7, 3, 2)
    assert b"pickle" not in encoder.encode(req)  # plain msgpack
    assert isinstance(msgspec.msgpack.decode(encoder.encode(req)), dict)


def _feature(pixels: torch.Tensor, sizes: torch.Tensor) -> MMFeature:
    data = {"pixel_values": TensorData.from_tensor(pixels), "image_sizes": TensorData.from_tensor(sizes)}
    return MMFeature(0, 4, hash_tensors({"pixel_values": pixels}), data)


def test_encoder_inputs_keep_integer_metadata_on_the_host():
    """Pixels go to the runner's device; image sizes stay on the host, where the model reads them as numbers (on a
    GPU, reading them would wait for every queued step)."""
    pixels, sizes = torch.randn(2, 3, 4, 4).to(torch.bfloat16), torch.tensor([480, 640])
    got = _feature(pixels, sizes).tensors("cpu")
    assert torch.equal(got["pixel_values"], pixels) and got["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(got["image_sizes"], sizes)
    other = _feature(pixels, sizes).tensors("meta")  # a device other than the host's
    assert other["pixel_values"].device.type == "meta" and other["pixel_values"].shape == pixels.shape
    assert other["image_sizes"].device.type == "cpu" and other["image_sizes"].tolist() == [480, 640]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and a non-blocking copy need CUDA")
def test_encoder_inputs_to_cuda_through_pinned_memory():
    pixels, sizes = torch.randn(5, 3, 8, 8).to(torch.bfloat16), torch.tensor([600, 800])
    feat = _feature(pixels, sizes)
    assert feat.data["pixel_values"].to_tensor(pinned=True).is_pinned()
    got = feat.tensors(torch.device("cuda"))
    assert got["pixel_values"].is_cuda and torch.equal(got["pixel_values"].cpu(), pixels)
    assert got["image_sizes"].device.type == "cpu" and got["image_sizes"].tolist() == [600, 800]


def _request(rid, tokens, features=(), bidir=0, **extras):
    return Request(rid, list(tokens), SamplingParams(), max_tokens=4,
                   extras=RequestExtras(mm_features=list(features), bidirectional_len=bidir, **extras))


def test_block_hashes_follow_image_content():
    kv = KVCacheManager(64, 4)
    img = lambda h: MMFeature(4, 6, h)  # noqa: E731  placeholders 4..9: blocks 1 and 2
    toks = list(range(16))
    a, b, c = (kv._block_hashes(_request(r, toks, [img(h)])) for r, h in (("a", "x"), ("b", "y"), ("c", "x")))
    assert a[0] == b[0]  # the block before the image is shared
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]  # the image's blocks (and every later one) are not
    assert a == c  # the same image: the same hashes
    plain = kv._block_hashes(_request("d", toks))
    assert plain[0] == a[0] and plain[1] != a[1]


def test_plain_requests_send_no_extras():
    """A text request's extras are the shared default and cost nothing on the wire."""
    plain = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), 4, 0.0)
    assert b"extras" not in encoder.encode(plain)
    assert add_decoder.decode(encoder.encode(plain)).extras == RequestExtras()


def test_extras_reach_tensor_parallel_workers_whole():
    """The scheduler's deltas carry the extras to every worker rank (msgpack, executor/messages.py)."""
    from kestrel.core.step import NewRequestData, StepInput
    from kestrel.executor.messages import step_decoder

    t = torch.randn(2, 3)
    extras = RequestExtras(lora_id=3, mm_features=[MMFeature(1, 2, "h", {"pixel_values": TensorData.from_tensor(t)})],
                           bidirectional_len=5, cache_salt="s")
    step = StepInput([NewRequestData("r", [1, 2], [], SamplingParams(), [0], [[1]], extras)])
    back = step_decoder.decode(msgspec.msgpack.encode(step)).new_requests[0].extras
    assert back == extras and torch.equal(back.mm_features[0].data["pixel_values"].to_tensor(), t)


def test_block_hashes_follow_adapter_and_cache_salt():
    """Two adapters, or two cache salts, never share KV blocks; the same extras share all of them."""
    kv = KVCacheManager(64, 4)
    toks = list(range(12))
    base, lora1, lora2, salted = (kv._block_hashes(_request(r, toks, **x)) for r, x in (
        ("a", {}), ("b", {"lora_id": 1}), ("c", {"lora_id": 2}), ("d", {"cache_salt": "tenant-7"})))
    assert len({base[0], lora1[0], lora2[0], salted[0]}) == 4
    assert kv._block_hashes(_request("e", toks, lora_id=1)) == lora1


def test_bidirectional_prefix_must_fit_one_step():
    """The engine's rule (the frontend runs the same check): a prefix computed in one step fits the step budget."""
    RequestExtras(bidirectional_len=16).check_step_budget(16)
    with pytest.raises(InvalidRequest, match="bidirectional prefix .* 17 tokens.*--max-num-batched-tokens 16"):
        RequestExtras(bidirectional_len=17).check_step_budget(16)


def test_bidirectional_prefix_blocks_depend_on_the_whole_prefix():
    kv = KVCacheManager(64, 4)
    a = kv._block_hashes(_request("a", list(range(12)), bidir=10))
    b = kv._block_hashes(_request("b", list(range(9)) + [99, 10, 11], bidir=10))  # differs at token 9 only
    assert a[0] != b[0] and a[1] != b[1]  # token 9 reached every prefix token's K/V


def test_reference_attention_bidirectional_prefix():
    torch.manual_seed(0)
    bs, heads, d, n, L = 4, 2, 8, 10, 6
    k_cache, v_cache = torch.randn(4, bs, heads, d), torch.randn(4, bs, heads, d)
    q = torch.randn(n, heads, d)
    table = torch.tensor([[2, 0, 3, 1]])
    out = paged_attention_ref(q, k_cache, v_cache, table, [0, n], [n], 0.5, bidirectional_lens=[L])
    k = k_cache[table[0].long()].flatten(0, 1)[:n]
    v = v_cache[table[0].long()].flatten(0, 1)[:n]
    pos = torch.arange(n)
    mask = (pos[None] <= pos[:, None]) | ((pos[None] < L) & (pos[:, None] < L))
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.5
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    assert torch.allclose(out, ref, atol=1e-5)
    causal = paged_attention_ref(q, k_cache, v_cache, table, [0, n], [n], 0.5)
    assert not torch.allclose(out[:L - 1], causal[:L - 1], atol=1e-3) and torch.allclose(out[L:], causal[L:])


def test_selection_needs_bidirectional_support(monkeypatch):
    """A model that declares a bidirectional prefix (its runner gets the prefix-mask add-on) gets only a backend
    that declares support for it."""
    import kestrel.attention.selector as selector

    spec = FullAttentionSpec(torch.float32, 2, 16)

    class CausalOnly(TorchRefBackend):
        name = "causal_only"
        supports_bidirectional_prefix = False

    monkeypatch.setattr(selector, "backend_candidates", lambda: [CausalOnly, TorchRefBackend])
    assert select_attention_backend(spec, 16) is CausalOnly
    needs = BidirectionalPrefix.backend_requires
    assert select_attention_backend(spec, 16, requires=needs) is TorchRefBackend
    with pytest.raises(ConfigError, match="causal_only: lacks supports_bidirectional_prefix"):
        select_attention_backend(spec, 16, forced="causal_only", requires=needs)
    assert not AttentionBackend.supports_bidirectional_prefix  # backends opt in (Triton does not)

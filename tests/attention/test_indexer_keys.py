"""FP8 indexer keys (kestrel/attention/indexer_keys.py) on their own: the Hadamard rotation is the normalized
Walsh-Hadamard matrix and leaves scores unchanged; the quantize / dequantize round trip stays within float8 e4m3's
rounding; fp8 scores select >= 95% of the float32 top-k on random inputs with 16 and 64 heads; the spec's pages
hold 132 bytes a token for the keys at 128 dims, and the flag re-types only DSA specs."""
import pytest
import torch

from kestrel.attention.backends.torch_sparse_mla import index_scores_ref, select_topk_ref
from kestrel.attention.indexer_keys import (dequantize_index_keys, hadamard_rotate, quantize_index_keys,
                                            quantize_index_queries, specs_with_index_key_dtype)
from kestrel.core.kv_spec import MLASpec, SparseMLASpec
from kestrel.errors import ConfigError

FP8 = torch.float8_e4m3fn


def walsh_hadamard(d: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(d): the Walsh-Hadamard matrix in natural (Sylvester) order."""
    i = torch.arange(d)
    bits = torch.tensor([bin(v).count("1") for v in (i[:, None] & i[None, :]).flatten().tolist()]).view(d, d)
    return (1 - 2 * (bits % 2)).float() / d ** 0.5


@pytest.mark.parametrize("d", [16, 32, 128])
def test_hadamard_is_the_normalized_walsh_hadamard_matrix(d):
    x = torch.randn(7, 3, d, generator=torch.Generator().manual_seed(d))
    got = hadamard_rotate(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ walsh_hadamard(d), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hadamard_rotate(got), x, rtol=1e-5, atol=1e-5)  # H is its own inverse
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.randn(2, 24))


def test_rotation_leaves_scores_unchanged():
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(6, 16, 128, generator=gen), torch.randn(300, 128, generator=gen), torch.randn(6, 16,
                                                                                                        generator=gen)
    plain = index_scores_ref(q, w, k)
    rotated = index_scores_ref(hadamard_rotate(q), w, hadamard_rotate(k))
    assert (rotated - plain).norm() / plain.norm() < 1e-6
    # in bf16 the rotation changes the scores by rounding only
    rotated_bf16 = index_scores_ref(hadamard_rotate(q).bfloat16(), w, hadamard_rotate(k).bfloat16())
    plain_bf16 = index_scores_ref(q.bfloat16(), w, k.bfloat16())
    assert (rotated_bf16 - plain).norm() / plain.norm() < 1e-2 and (plain_bf16 - plain).norm() / plain.norm() < 1e-2


def test_round_trip_within_e4m3_rounding_and_power_of_two_scales():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 2, 64)[:, None]  # rows over 5 decades
    k[3, 5] = 40.0  # an outlier: the rotation spreads it
    k8, scale = quantize_index_keys(k)
    assert k8.dtype == FP8 and k8.shape == (64, 128) and scale.shape == (64, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # ue8m0: powers of two
    rotated = hadamard_rotate(k)
    amax = rotated.abs().amax(-1, keepdim=True)
    assert ((amax / scale > 224) & (amax / scale <= 448)).all()  # the largest value lands in the top binade
    err = (dequantize_index_keys(k8, scale) - rotated).abs()
    # e4m3: 3 mantissa bits, half an ulp is 2^-4 of the value; below 2^-6 (subnormals) 2^-10 absolute
    assert (err <= torch.maximum(rotated.abs() * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001).all()
    assert (err / rotated.abs().clamp(min=1e-30)).median() < 0.04


def test_query_scales_fold_into_weights():
    gen = torch.Generator().manual_seed(2)
    q, w = torch.randn(5, 16, 32, generator=gen) * 3, torch.rand(5, 16, generator=gen)
    q8, w8 = quantize_index_queries(q, w)
    assert q8.dtype == FP8 and w8.dtype == torch.float32
    scale = w8 / w
    torch.testing.assert_close(scale, torch.exp2(torch.log2(scale).round()))
    deq = q8.float() * scale[..., None]
    rotated = hadamard_rotate(q)
    assert ((deq - rotated).abs() <= rotated.abs() * 2.0 ** -4 + scale[..., None] * 2.0 ** -10).all()


@pytest.mark.parametrize("heads,dim,seq,topk", [(16, 32, 600, 64), (16, 128, 2000, 256), (64, 128, 3000, 2048)])
def test_fp8_topk_recall_against_unquantized(heads, dim, seq, topk):
    """The reference's paged top-k over an fp8 (keys, scales) cache vs over the float32 keys: >= 95% of the
    selection in common (random keys and queries, 4 queries at the end of a 4-block-paged context)."""
    gen = torch.Generator().manual_seed(heads + dim)
    keys, q, w = (torch.randn(seq, dim, generator=gen), torch.randn(4, heads, dim, generator=gen),
                  torch.randn(4, heads, generator=gen))
    page = 16
    table = torch.randperm(seq // page + 1, generator=gen)[None].int()
    cache = torch.zeros(seq // page + 1, page, dim)
    k8_cache = torch.zeros(seq // page + 1, page, dim, dtype=FP8)
    s_cache = torch.zeros(seq // page + 1, page, 1)
    k8, ks = quantize_index_keys(keys)
    for p in range(seq):
        b, o = table[0, p // page], p % page
        cache[b, o], k8_cache[b, o], s_cache[b, o] = keys[p], k8[p], ks[p]
    want = select_topk_ref(q, w, cache, table, [0, 4], [seq], topk)
    q8, w8 = quantize_index_queries(q, w)
    got = select_topk_ref(q8, w8, (k8_cache, s_cache), table, [0, 4], [seq], topk)
    hits = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, want))
    assert (got >= 0).sum() == (want >= 0).sum()
    assert hits / (want >= 0).sum().item() >= 0.95


def test_fp8_pages_hold_132_bytes_a_token_and_cross_to_workers():
    from kestrel.core.kv_spec import group_layers
    from kestrel.executor.messages import decode_groups, encode_groups

    bf16 = SparseMLASpec(torch.bfloat16, 512, 64, index_head_dim=128, index_topk=2048)
    specs = specs_with_index_key_dtype({"a": bf16, "b": bf16, "m": MLASpec(torch.bfloat16)}, "fp8")
    fp8 = specs["a"]
    assert fp8.index_dtype == FP8 and specs["m"] == MLASpec(torch.bfloat16)
    assert bf16.page_bytes == 16 * (1152 + 256) and fp8.page_bytes == 16 * (1152 + 132)
    rows = torch.zeros(3, fp8.page_bytes, dtype=torch.uint8)
    latent, (keys, scales) = fp8.layer_view(rows)
    assert latent.shape == (3, 16, 576) and keys.shape == (3, 16, 128) and scales.shape == (3, 16, 1)
    assert keys.dtype == FP8 and scales.dtype == torch.float32
    scales.fill_(1.0)
    keys.view(torch.uint8).fill_(0x38)  # 1.0 in e4m3
    assert latent.abs().sum() == 0 and torch.equal(keys.float(), torch.ones(3, 16, 128))
    assert scales.sum() == 3 * 16  # the keys did not overwrite the scales
    groups = group_layers({"a": fp8, "b": fp8}, 16)
    assert [g.spec for g in decode_groups(encode_groups(groups))] == [g.spec for g in groups]
    assert specs_with_index_key_dtype({"a": bf16}, "bf16") == {"a": bf16}


def test_index_key_dtype_errors():
    spec = SparseMLASpec(torch.bfloat16, 512, 64, index_head_dim=256)
    with pytest.raises(ConfigError, match="index_head_dim 256"):
        specs_with_index_key_dtype({"layers.0": spec}, "fp8")
    with pytest.raises(ConfigError, match="--indexer-key-dtype fp16"):
        specs_with_index_key_dtype({"layers.0": spec}, "fp16")


def test_triton_backend_reads_fp8_keys_only_with_triton_float8():
    pytest.importorskip("triton")
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend
    from kestrel.platform import fake_platform, set_platform_for_testing
    from kestrel.platform.triton_gates import interpreter_mode

    if interpreter_mode():
        pytest.skip("the interpreter converts float8 on any machine")
    spec = SparseMLASpec(torch.bfloat16, 512, 64, index_head_dim=128, index_dtype=FP8)
    try:
        set_platform_for_testing(fake_platform("sm_80"))
        ok, why = TritonSparseMLABackend.validate_spec(spec)
        assert not ok and "float8 indexer keys need Triton float8 conversions (sm_89+)" in why
        assert TritonSparseMLABackend.validate_spec(SparseMLASpec(torch.bfloat16, 512, 64)) == (True, "")
        set_platform_for_testing(fake_platform("sm_90"))
        assert TritonSparseMLABackend.validate_spec(spec) == (True, "")
    finally:
        set_platform_for_testing(None)

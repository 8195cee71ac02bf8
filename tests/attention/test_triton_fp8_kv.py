"""The Triton paged-attention ops over a float8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2) against the PyTorch
references: the cache writes (plain and fused with q/k norm + rotary) quantise as kv_quant.quantize does, and
decode / prefill (full and sliding-window) read the cache as the reference does.

Runs on CUDA, or on the CPU under the Triton interpreter (TRITON_INTERPRET=1, `make kernels-check`); skips
otherwise. The interpreter's float32 -> float8 cast rounds wrongly (ties away from zero, and a value that rounds
up to the next power of two drops to the power below: 31.1 -> 16 in e4m3), so under the interpreter the writes get
values that are float8 codes times power-of-two scales (the cast is then exact) and the test checks the scaling,
saturation and placement; on the GPU they get random values, and the float8 codes must equal torch's (or, where
the kernel's float32 arithmetic differs from the unfused bf16 steps, be one code apart in a few places)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

if _ok:
    from kestrel.attention.ops import reference as ref
    from kestrel.attention.ops import triton_attention as ta
    from kestrel.kernels.triton_ops.fused_ops import qk_norm_rope_cache

from kestrel.attention import kv_quant  # noqa: E402
from tests.attention.paged_cases import paged_case, poison_outside_window, rope_cos_sin, unfused_prologue  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
D = 64 if DEVICE == "cuda" else 32
INTERPRETED = DEVICE == "cpu"
TOL = 1e-2  # ||out - ref|| / ||ref||, bf16 queries (as the bf16 tests of test_triton_ops.py)


def scales(k_scale: float, v_scale: float):
    return (torch.tensor([k_scale], device=DEVICE), torch.tensor([v_scale], device=DEVICE))


def assert_same_codes(cache, expect, near: bool = False):
    """Equal float8 codes; `near`: adjacent codes (a rounding difference) allowed in at most 2% of them."""
    a, b = cache.view(torch.uint8).int(), expect.view(torch.uint8).int()
    diff = (a - b).abs()
    assert int(diff.max()) <= (1 if near else 0), int(diff.max())
    assert float((diff > 0).float().mean()) <= 0.02


def kv_values(shape, scale, cache_dtype, gen, spread=1.0):
    """bf16 values ~ spread x N(0, 1); under the interpreter snapped to float8 codes x scale (a power of two)."""
    x = torch.randn(*shape, generator=gen) * spread
    if INTERPRETED:
        x = kv_quant.dequantize(kv_quant.quantize(x, scale, cache_dtype), scale)
    return x.to(DEVICE, torch.bfloat16)


def rel_err(out, expect):
    out, expect = out.double(), expect.double()
    assert torch.isfinite(out).all()
    return ((out - expect).norm() / expect.norm()).item()


@pytest.mark.parametrize("cache_dtype", FP8)
def test_cache_write_quantises(cache_dtype):
    gen = torch.Generator().manual_seed(1)
    T, hkv, nb, page = 13, 2, 4, 16
    key = kv_values((T, hkv, D), 2 ** -4, cache_dtype, gen, 3.0)
    value = kv_values((T, hkv, D), 2 ** -6, cache_dtype, gen)
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])  # beyond the range: saturated to +-max
    slots = torch.randperm(nb * page, generator=gen)[:T].to(torch.int64)
    slots[3] = -1
    slots = slots.to(DEVICE)
    ks, vs = scales(2 ** -4, 2 ** -6)
    kc, vc = (torch.zeros(nb, page, hkv, D, dtype=cache_dtype, device=DEVICE) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    ta.reshape_and_cache(key, value, kc, vc, slots, ks, vs)
    ref.reshape_and_cache_ref(key, value, kr, vr, slots, ks, vs)
    assert_same_codes(kc, kr)
    assert_same_codes(vc, vr)
    assert kc.float().abs().max().item() == kv_quant.fp8_max(cache_dtype)
    with pytest.raises(ValueError, match="KV cache needs k_scale and v_scale"):
        ta.reshape_and_cache(key, value, kc, vc, slots)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("with_norm", [False, True])
def test_fused_prologue_quantises_as_the_unfused_chain(cache_dtype, with_norm):
    """Under the interpreter: no norm and position 0 (rotary is the identity), so k and v reach the cast on the
    float8 grid; on the GPU: random positions, the norm on."""
    if INTERPRETED and with_norm:
        pytest.skip("the interpreter's float8 cast is exact only for values on the float8 grid (no norm there)")
    gen = torch.Generator().manual_seed(11)
    T, hq, hkv, max_pos, page, blocks = 9, 4, 2, 300, 16, 8
    cos_sin = rope_cos_sin(D, max_pos, DEVICE)
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE) * (0 if INTERPRETED else 1)
    qkv = kv_values((T, (hq + 2 * hkv) * D), 2 ** -5, cache_dtype, gen)
    qw = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEVICE, torch.bfloat16) if with_norm else None
    kw = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEVICE, torch.bfloat16) if with_norm else None
    slots = torch.randperm(blocks * page, generator=gen)[:T].to(DEVICE)
    slots[2] = -1
    ks, vs = scales(2 ** -5, 2 ** -5)
    kc, vc = (torch.zeros(blocks, page, hkv, D, dtype=cache_dtype, device=DEVICE) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()

    _, k_ref, v_ref = unfused_prologue(qkv, pos, cos_sin, hq, hkv, D, qw, kw)
    ref.reshape_and_cache_ref(k_ref, v_ref, kr, vr, slots, ks, vs)

    qk_norm_rope_cache(qkv, pos, cos_sin, hq, hkv, D, kc, vc, slots, qw, kw, 1e-6, ks, vs)
    # k passes through norm + rotary in float32 inside the kernel (bf16 between the unfused steps): a value near a
    # float8 rounding boundary may land on the neighbouring code
    assert_same_codes(kc, kr, near=True)
    assert_same_codes(vc, vr)


def quantised_case(q_lens, seq_lens, page, hq, hkv, cache_dtype, gen, k_scale, v_scale):
    """paged_case with its K/V quantised into a float8 cache (K ~ 3 x N(0, 1), V ~ N(0, 1))."""
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, page, hq, hkv, D, torch.float32, gen)
    kq = kv_quant.quantize(kc * 3, k_scale, cache_dtype)
    vq = kv_quant.quantize(vc, v_scale, cache_dtype)
    move = (lambda t: t.to(DEVICE))
    return move(q.to(torch.bfloat16)), move(kq), move(vq), move(bt), move(qsl), move(sl)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_reads_a_float8_cache(cache_dtype, window, splits):
    gen = torch.Generator().manual_seed(3)
    seq_lens = [37, 0, 1, 70]
    q, kc, vc, bt, _, sl = quantised_case([1] * 4, seq_lens, 16, 4, 2, cache_dtype, gen, 0.03, 0.01)
    ks, vs = scales(0.03, 0.01)
    out = torch.full_like(q, float("nan"))
    cfg = {"BLOCK_N": 16, "MIN_SPLIT": 16} if DEVICE == "cpu" else {"MIN_SPLIT": 16}
    ta.decode_attention(q, kc, vc, bt, sl, D ** -0.5, out=out, num_splits=splits, sliding_window=window,
                        k_scale=ks, v_scale=vs, _config=cfg)
    expect = ref.decode_attention_ref(q.float(), kc, vc, bt, sl, D ** -0.5, sliding_window=window,
                                      k_scale=ks, v_scale=vs)
    assert torch.all(out[1] == 0)
    assert rel_err(out, expect) < TOL


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("window", [0, 8])
def test_prefill_reads_a_float8_cache(cache_dtype, window):
    """Cached prefixes and new tokens; with a window, everything below it poisoned (NaN in float8: never read)."""
    gen = torch.Generator().manual_seed(2)
    q_lens = [9, 1, 20]
    seq_lens = [26, 21, 20]
    q, kc, vc, bt, qsl, sl = quantised_case(q_lens, seq_lens, 16, 8, 2, cache_dtype, gen, 0.05, 0.02)
    ks, vs = scales(0.05, 0.02)
    expect = ref.prefill_attention_ref(q.float(), kc, vc, bt, qsl, sl, 0.15, sliding_window=window,
                                       k_scale=ks, v_scale=vs)
    if window:
        kc, vc, bt = poison_outside_window(kc, vc, bt, q_lens, seq_lens, window)
    out = torch.full_like(q, float("nan"))
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16} if DEVICE == "cpu" else None
    ta.prefill_attention(q, kc, vc, bt, qsl, sl, 0.15, out=out, max_query_len=20, sliding_window=window,
                         k_scale=ks, v_scale=vs, _config=cfg)
    assert rel_err(out, expect) < TOL

"""M-RoPE through the fused Triton kernels: RotaryEmbedding.cos_sin_for turns [3, T] positions into each token's
own cos|sin row (indexed 0..T-1), and the in-place rotary and the fused q/k-norm + rotary + cache-write prologue
read it as they read the shared table. Against RotaryEmbedding.rotate_copies (the PyTorch M-RoPE, itself held to
transformers in test_mrope_rotary.py). Runs on CUDA, or on the CPU under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rotary(d: int, interleaved: bool):
    from transformers import Qwen2_5_VLTextConfig

    from kestrel.layers.rotary import RotaryEmbedding

    cfg = Qwen2_5_VLTextConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d)
    sections = [d // 8, 3 * d // 16, 3 * d // 16] if not interleaved else [d // 6 + 1, d // 6, d // 6]
    sections[0] += d // 2 - sum(sections)
    return RotaryEmbedding(cfg, d, 300, torch.float32, mrope=(sections, interleaved)).to(DEVICE)


def rel_err(out, expect):
    out, expect = out.double(), expect.double()
    return ((out - expect).norm() / expect.norm()).item()


@pytest.mark.parametrize("interleaved", [False, True])
def test_in_place_rotary_reads_the_per_token_table(interleaved):
    from kestrel.kernels.triton_ops.fused_ops import rotary_embedding_

    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 7, 4, 2, 64
    rot = rotary(d, interleaved)
    positions = torch.randint(0, 300, (3, t), generator=gen).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEVICE)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    q_ref, k_ref = rot.rotate_copies(positions, q.clone(), k.clone())
    index, table = rot.cos_sin_for(positions)
    rotary_embedding_(index, q, k, table, d, True)
    assert rel_err(q, q_ref) < 1e-5 and rel_err(k, k_ref) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_prologue_reads_the_per_token_table(interleaved):
    from kestrel.kernels.triton_ops.fused_ops import qk_norm_rope_cache

    gen = torch.Generator().manual_seed(4)
    t, hq, hkv, d, page, blocks = 9, 4, 2, 64, 16, 4
    rot = rotary(d, interleaved)
    positions = torch.randint(0, 300, (3, t), generator=gen).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEVICE)
    slots = torch.randperm(blocks * page, generator=gen)[:t].to(DEVICE)
    kc, vc = (torch.zeros(blocks, page, hkv, d, device=DEVICE) for _ in range(2))
    q = qk_norm_rope_cache(qkv, *rot.cos_sin_for(positions), hq, hkv, d, kc, vc, slots, None, None, 1e-6)
    q_ref, k_ref = rot.rotate_copies(positions, qkv[:, :hq * d].view(t, hq, d),
                                     qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d))
    assert rel_err(q, q_ref) < 1e-5
    assert rel_err(kc.view(-1, hkv, d)[slots], k_ref) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_forward_takes_the_fused_path(interleaved, monkeypatch):
    """RotaryEmbedding.forward hands the kernel its (index, table) pair in the kernel's argument order (the CPU's
    forward otherwise takes the copies path: the fused ops are switched on for this test)."""
    from kestrel.kernels.triton_ops import fused_ops
    from kestrel.layers import rotary as rotary_module

    monkeypatch.setattr(rotary_module, "fused_ops_for", lambda x: fused_ops)
    gen = torch.Generator().manual_seed(5)
    t, hq, hkv, d = 5, 4, 2, 64
    rot = rotary(d, interleaved)
    positions = torch.randint(0, 300, (3, t), generator=gen).to(DEVICE)
    q, k = torch.randn(t, hq, d, generator=gen).to(DEVICE), torch.randn(t, hkv, d, generator=gen).to(DEVICE)
    q_ref, k_ref = rot.rotate_copies(positions, q, k)
    q_out, k_out = rot(positions, q.clone(), k.clone())
    assert rel_err(q_out, q_ref) < 1e-5 and rel_err(k_out, k_ref) < 1e-5

"""M-RoPE as an option of RotaryEmbedding against transformers' own rotary classes on random inputs: Qwen2.5-VL's
sectioned [16, 24, 24] and Qwen3-VL's interleaved layout, [3, T] positions with different rows; [T] positions
are plain RoPE; the per-token table the fused kernels read gives the same rotation."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.rotary import RotaryEmbedding, mrope_option, mrope_rows


def hf_rotate(kind: str, head_dim: int, sections, positions, q, k):
    """transformers' rotation of q, k [T, H, D] at positions [3, T]."""
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLTextConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Rotary
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb
    else:
        from transformers import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb
    cfg = Config(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections})
    rot = Rotary(cfg)
    cos, sin = rot(q, positions[:, None, :])  # [1, T, D]
    qe, ke = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qe[0].transpose(0, 1), ke[0].transpose(0, 1), cfg


CASES = [("qwen2_5_vl", 64, [8, 12, 12], False), ("qwen2_5_vl", 128, [16, 24, 24], False),
         ("qwen3_vl", 64, [12, 10, 10], True), ("qwen3_vl", 128, [24, 20, 20], True)]


@pytest.mark.parametrize("kind,head_dim,sections,interleaved", CASES)
def test_mrope_matches_transformers(kind, head_dim, sections, interleaved):
    torch.manual_seed(0)
    t = 37
    positions = torch.stack([torch.randint(0, 300, (t,)) for _ in range(3)])
    q, k = torch.randn(t, 4, head_dim), torch.randn(t, 2, head_dim)
    ref_q, ref_k, cfg = hf_rotate(kind, head_dim, sections, positions, q, k)
    assert mrope_option(cfg) == (sections, False)  # the config's sections; interleaving is the family's
    rot = RotaryEmbedding(cfg, head_dim, 512, torch.float32, mrope=(sections, interleaved))
    ours_q, ours_k = rot.rotate_copies(positions, q, k)
    torch.testing.assert_close(ours_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, ref_k, atol=1e-5, rtol=1e-5)
    # the other layout gives other results (the test can tell them apart)
    other = RotaryEmbedding(cfg, head_dim, 512, torch.float32, mrope=(sections, not interleaved))
    assert not torch.allclose(other.rotate_copies(positions, q)[0], ref_q, atol=1e-3)
    # the fused kernels' form: table[index] per token
    index, table = rot.cos_sin_for(positions)
    assert table.shape == (t, head_dim) and torch.equal(index, torch.arange(t))


def test_one_row_positions_are_plain_rope():
    from transformers import Qwen2_5_VLTextConfig

    cfg = Qwen2_5_VLTextConfig(hidden_size=256, num_attention_heads=4, head_dim=64)
    torch.manual_seed(1)
    pos = torch.randint(0, 400, (20,))
    q = torch.randn(20, 4, 64)
    m = RotaryEmbedding(cfg, 64, 512, torch.float32, mrope=([8, 12, 12], False))
    plain = RotaryEmbedding(cfg, 64, 512, torch.float32)
    torch.testing.assert_close(m.rotate_copies(pos, q)[0], plain.rotate_copies(pos, q)[0])
    torch.testing.assert_close(m.rotate_copies(pos.expand(3, -1), q)[0], plain.rotate_copies(pos, q)[0])


def test_mrope_rows_layouts():
    assert mrope_rows([2, 3, 3], False, 8).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert mrope_rows([3, 2, 2], True, 7).tolist() == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="covers 7 of the rotary's 8"):
        mrope_rows([2, 2, 3], False, 8)


def test_per_token_table_is_built_once_per_positions_tensor():
    """Every layer of a forward passes the same positions tensor: the table is gathered once; a new tensor (the
    next step's view of the buffers, even with equal values) gets its own."""
    from transformers import Qwen2_5_VLTextConfig

    rot = RotaryEmbedding(Qwen2_5_VLTextConfig(hidden_size=256, num_attention_heads=4, head_dim=64), 64, 512,
                          torch.float32, mrope=([8, 12, 12], False))
    buf = torch.randint(0, 400, (3, 32))
    step = buf[..., :10]
    first = rot.cos_sin_for(step)
    assert rot.cos_sin_for(step)[1] is first[1]
    buf[0, 0] += 1
    again = rot.cos_sin_for(buf[..., :10])
    assert again[1] is not first[1] and not torch.equal(again[1], first[1])

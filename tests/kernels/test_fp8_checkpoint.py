"""tests/fp8_utils.make_fp8_checkpoint + the Linear loading path: FP8 tensors of a real (tiny) HF checkpoint
loaded through Linear.load_weight, as the model loader will, compared with the dequantized dense result."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kestrel.kernels.fp8 import Fp8DequantFallbackLinear, TorchScaledMMLinear
from kestrel.kernels.fp8_quant import dequantize_block
from kestrel.layers.linear import Linear
from kestrel.layers.quant import get_quant_config
from kestrel.platform.testing import use_platform

from tests.fp8_utils import make_fp8_checkpoint
from tests.kernels.fp8_helpers import reference_activation, rel_err

HIDDEN, INTER, HEADS, KV_HEADS = 64, 192, 4, 2
HEAD_DIM = HIDDEN // HEADS

# (fused module, checkpoint shards, input size, output sizes)
LAYERS = [
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), HIDDEN, (HIDDEN, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)),
    ("self_attn.o_proj", ("o_proj",), HIDDEN, (HIDDEN,)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj"), HIDDEN, (INTER, INTER)),
    ("mlp.down_proj", ("down_proj",), INTER, (HIDDEN,)),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {fmt: make_fp8_checkpoint(tiny_llama, root / fmt, fmt) for fmt in ("block", "per_tensor", "per_channel")}


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _build_and_load(path, tensors, layer_idx, fused, shards, k, sizes, quantization=None, backend="auto"):
    config = json.loads((path / "config.json").read_text())
    qcfg = get_quant_config(config, quantization, torch.float32)
    prefix = f"model.layers.{layer_idx}.{fused}"
    layer = Linear(k, list(sizes), params_dtype=torch.float32, prefix=prefix, quant_config=qcfg, backend=backend)
    module_dir = prefix.rsplit(".", 1)[0]
    merged = len(shards) > 1
    for shard_id, shard in enumerate(shards):
        src = f"{module_dir}.{shard}."
        for name, t in tensors.items():
            if name.startswith(src):
                layer.load_weight(name[len(src):], t, shard_id=shard_id if merged else None)
    layer.process_weights_after_loading()
    return layer


def _dequantized(fmt, tensors, module):
    w = tensors[f"{module}.weight"]
    if fmt == "block":
        return dequantize_block(w, tensors[f"{module}.weight_scale_inv"], (128, 128))
    return w.float() * tensors[f"{module}.weight_scale"].float().reshape(-1, 1)


def test_converter_writes_each_format(fp8_checkpoints, tiny_llama):
    src = _tensors(tiny_llama)
    for fmt, path in fp8_checkpoints.items():
        qc = json.loads((path / "config.json").read_text())["quantization_config"]
        t = _tensors(path)
        q = "model.layers.0.self_attn.q_proj"
        assert t[f"{q}.weight"].dtype == torch.float8_e4m3fn
        assert t["lm_head.weight"].dtype == src["lm_head.weight"].dtype  # never quantized
        assert t["model.embed_tokens.weight"].dtype == src["model.embed_tokens.weight"].dtype
        if fmt == "block":
            assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
            assert "lm_head" in qc["modules_to_not_convert"]
            assert t[f"{q}.weight_scale_inv"].shape == (1, 1)
            assert t["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)  # [64, 192] -> 1 x 2 blocks
        else:
            assert qc["quant_method"] == "compressed-tensors" and "lm_head" in qc["ignore"]
            assert t[f"{q}.weight_scale"].shape == ((1,) if fmt == "per_tensor" else (HIDDEN, 1))
            assert (f"{q}.input_scale" in t) is (fmt == "per_tensor")
        for name, w in src.items():
            if name.endswith("_proj.weight"):
                assert rel_err(_dequantized(fmt, t, name[: -len(".weight")]), w) < 5e-2, (fmt, name)


@pytest.mark.parametrize("fmt", ["block", "per_tensor", "per_channel"])
@pytest.mark.parametrize("fused,shards,k,sizes", LAYERS, ids=[l[0] for l in LAYERS])
def test_linear_loads_fp8_checkpoint_fallback(fp8_checkpoints, tiny_llama, fmt, fused, shards, k, sizes):
    path = fp8_checkpoints[fmt]
    tensors = _tensors(path)
    with use_platform("cpu"):
        layer = _build_and_load(path, tensors, 1, fused, shards, k, sizes)
    assert type(layer.kernel) is Fp8DequantFallbackLinear
    module_dir = f"model.layers.1.{fused}".rsplit(".", 1)[0]
    w_ref = torch.cat([_dequantized(fmt, tensors, f"{module_dir}.{s}") for s in shards])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    assert rel_err(y, x @ w_ref.T) < 2e-2
    dense = _tensors(tiny_llama)
    w_src = torch.cat([dense[f"{module_dir}.{s}.weight"] for s in shards]).float()
    assert rel_err(y, x @ w_src.T) < 5e-2


@pytest.mark.parametrize("fmt", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("fused,shards,k,sizes", LAYERS, ids=[l[0] for l in LAYERS])
def test_linear_loads_fp8_checkpoint_scaled_mm(fp8_checkpoints, fmt, fused, shards, k, sizes):
    """The same checkpoint on a fake sm_90: auto selects torch_scaled_mm (which also runs on this CPU)."""
    path = fp8_checkpoints[fmt]
    tensors = _tensors(path)
    with use_platform("sm_90"):
        layer = _build_and_load(path, tensors, 0, fused, shards, k, sizes)
        assert type(layer.kernel) is TorchScaledMMLinear
        module_dir = f"model.layers.0.{fused}".rsplit(".", 1)[0]
        w_ref = torch.cat([_dequantized(fmt, tensors, f"{module_dir}.{s}") for s in shards])
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
        y = layer(x)
        ckpt = [{"input_scale": tensors[f"{module_dir}.{s}.input_scale"]} for s in shards] if fmt == "per_tensor" else None
        x_ref = reference_activation(layer.spec.quant, x, ckpt)
        assert rel_err(y, x_ref @ w_ref.T) < 2e-2


@pytest.mark.parametrize("arch,expected", [("cpu", Fp8DequantFallbackLinear), ("sm_90", TorchScaledMMLinear)])
def test_quantize_on_load_from_dense_checkpoint(tiny_llama, arch, expected):
    dense = _tensors(tiny_llama)
    with use_platform(arch):
        fused, shards, k, sizes = LAYERS[0]
        layer = _build_and_load(tiny_llama, dense, 0, fused, shards, k, sizes, quantization="fp8")
        assert type(layer.kernel) is expected
        w = torch.cat([dense[f"model.layers.0.self_attn.{s}.weight"] for s in shards]).float()
        x = torch.randn(4, k, generator=torch.Generator().manual_seed(2))
        assert rel_err(layer(x), x @ w.T) < 5e-2

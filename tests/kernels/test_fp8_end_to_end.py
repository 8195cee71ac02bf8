"""Tiny FP8 checkpoints (both formats) through the real loader and the CPU fallback kernel: the bf16 engine agrees,
teacher-forced (tests/agreement.py), with transformers on the same weights dequantized into a plain checkpoint."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel import LLM, SamplingParams
from tests.agreement import assert_teacher_forced
from tests.fp8_utils import make_fp8_checkpoint

PROMPTS = [[5, 17, 99, 3], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def dequantized_copy(fp8_dir, dst):
    """Plain checkpoint whose weights are exactly the FP8 weights times their scales (bf16)."""
    shutil.copytree(fp8_dir, dst)
    tensors = {}
    for f in fp8_dir.glob("*.safetensors"):
        tensors.update(load_file(f))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            base = name[: -len("weight")]
            w = t.float()
            if base + "weight_scale_inv" in tensors:  # block-wise [ceil(out/128), ceil(in/128)]
                s = tensors[base + "weight_scale_inv"].float()
                s = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
                w = w * s
            else:  # per-tensor [1] or per-channel [out, 1]
                w = w * tensors[base + "weight_scale"].float().reshape(-1, 1)
            t = w
        out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def tokens(path, dtype, **kw):
    llm = LLM(str(path), dtype=dtype, progress=False, **kw)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("fmt", ["block", "per_tensor", "per_channel"])
def test_fp8_checkpoint_greedy_matches_dequantized(tiny_models, tmp_path, fmt):
    fp8 = make_fp8_checkpoint(tiny_models["llama"], tmp_path / f"fp8_{fmt}", fmt=fmt)
    llm = LLM(str(fp8), dtype="bfloat16", progress=False)
    kernels = {m.kernel.name for m in llm.engine.core.executor.runner.model.modules() if hasattr(m, "kernel")}
    assert kernels == {"fp8_dequant_fallback"}  # what auto selection reaches on the CPU
    assert_teacher_forced(llm, dequantized_copy(fp8, tmp_path / f"deq_{fmt}"), PROMPTS)


def test_quantize_on_load_matches_per_channel_checkpoint(tiny_models, tmp_path):
    """--quantization fp8 on a plain checkpoint == the same weights quantized per channel offline (float32: the
    same weights and the same arithmetic, so the tokens are identical, not merely close)."""
    # float32 activations: both paths then quantize the same fp32 weights (bf16 would round them first on load)
    llm, q = tokens(tiny_models["llama"], dtype="float32", quantization="fp8")
    assert {m.kernel.name for m in llm.engine.core.executor.runner.model.modules() if hasattr(m, "kernel")} == \
        {"fp8_dequant_fallback"}
    _, offline = tokens(make_fp8_checkpoint(tiny_models["llama"], tmp_path / "fp8_pc", fmt="per_channel"), "float32")
    assert q == offline  # the same float32 weights quantized by the same function: identical tokens


def test_forced_backend_that_cannot_serve_fails_at_startup(tiny_models, tmp_path):
    fp8 = make_fp8_checkpoint(tiny_models["llama"], tmp_path / "fp8_forced", fmt="block")
    with pytest.raises(Exception) as e:
        LLM(str(fp8), dtype="bfloat16", progress=False, linear_backend="torch_scaled_mm")
    assert "model.layers.0" in str(e.value) and "torch_scaled_mm" in str(e.value)


def test_fp8_block_deepseek_greedy_matches_dequantized(tiny_models, tmp_path):
    """A block-quantized DeepSeek-V3 (MLA; kv_b_proj's W_UK / W_UV come out of its FP8 kernel) loads through the
    FP8 path and decodes like its dequantized copy."""
    fp8 = make_fp8_checkpoint(tiny_models["deepseek_v3"], tmp_path / "fp8_ds", fmt="block")
    llm = LLM(str(fp8), dtype="bfloat16", progress=False)
    attn = llm.engine.core.executor.runner.model.layers[0].self_attn
    assert attn.kv_b_proj.kernel.name == "fp8_dequant_fallback" and attn.q_b_proj.kernel.name == "fp8_dequant_fallback"
    assert_teacher_forced(llm, dequantized_copy(fp8, tmp_path / "deq_ds"), PROMPTS)

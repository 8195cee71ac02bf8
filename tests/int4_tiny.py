"""A tiny Kimi-K2-like checkpoint (DeepSeek-V3 text model: MLA, layer 0 dense, then 8 routed experts + 1 shared,
sigmoid routing in one group) whose routed experts are INT4 in compressed-tensors' pack-quantized format, as
Kimi K2-Thinking / K2.5 / K2.6 ship them, beside its reference twin: the same model with the experts' dequantised
weights in float32, which transformers runs. Quantised here (symmetric, per group of 32 input columns, bf16
scales = amax / 7), packed and dequantised by compressed-tensors itself."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from tests.tiny import make_checkpoint

# Kimi-K2-Thinking's quantization_config (its config.json), as compressed-tensors wrote it
KIMI_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# Kimi K2's routing (one group, one shared expert, its scaling factor) on the tiny DeepSeek-V3 MoE
KIMI = dict(n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.827, moe_intermediate_size=64)
EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def kimi_scheme():
    from compressed_tensors.quantization import QuantizationScheme

    group = KIMI_QUANTIZATION_CONFIG["config_groups"]["group_0"]
    return QuantizationScheme(targets=group["targets"], weights=group["weights"])


def quantize_int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 in -8..7, bf16 scales [out, in / group]): symmetric min-max per group."""
    g = w.float().unflatten(-1, (-1, group))
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return q.flatten(-2), scale


def compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One projection's pack-quantized tensors, packed by compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q, scale = quantize_int4(w)
    return {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor(w.shape)}


def decompress(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression of one projection (its dtype: the scales')."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(dict(tensors), kimi_scheme())["weight"]


def kimi_int4_checkpoints(root: Path, tokenizer=None, seed: int = 0, **overrides) -> tuple[Path, Path]:
    """(the INT4 checkpoint, its dequantised float32 twin for transformers)."""
    from safetensors.torch import load_file, save_file

    ref = make_checkpoint("deepseek_v3_moe", root, seed=seed, tokenizer=tokenizer, name="kimi_int4_ref",
                          **{**KIMI, **overrides})
    (file,) = ref.glob("*.safetensors")
    weights, packed = load_file(file), {}
    for name in [n for n in weights if EXPERT.fullmatch(n)]:
        tensors = compress(weights[name])
        packed.update({name[:-len("weight")] + k: v for k, v in tensors.items()})
        weights[name] = decompress(tensors).float()
    save_file(weights, file, metadata={"format": "pt"})
    int4 = root / "kimi_int4"
    shutil.copytree(ref, int4)
    save_file({**{n: t for n, t in weights.items() if not EXPERT.fullmatch(n)}, **packed}, int4 / file.name,
              metadata={"format": "pt"})
    config = json.loads((int4 / "config.json").read_text())
    config["quantization_config"] = KIMI_QUANTIZATION_CONFIG
    (int4 / "config.json").write_text(json.dumps(config, indent=2))
    return int4, ref


def kimi_k25_checkpoint(int4: Path, root: Path) -> Path:
    """The INT4 checkpoint dressed as Kimi K2.5 ships (model_type kimi_k25): the text model's tensors under
    `language_model.`, a vision tower and projector beside them, the DeepSeek-V3 config as its text_config."""
    from safetensors.torch import load_file, save_file

    out = root / "kimi_k25"
    shutil.copytree(int4, out)
    (file,) = out.glob("*.safetensors")
    tensors = {("language_model." + n if n.startswith(("model.", "lm_head.")) else n): t
               for n, t in load_file(file).items()}
    tensors.update({"vision_tower.encoder.blocks.0.mlp.fc0.weight": torch.randn(8, 8),
                    "mm_projector.proj.0.weight": torch.randn(64, 8)})
    save_file(tensors, file, metadata={"format": "pt"})
    text = json.loads((out / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    quant = text.pop("quantization_config")
    quant["ignore"] = quant["ignore"] + ["re:.*vision_tower.*", "re:.*mm_projector.*"]
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": {**text, "quantization_config": quant}, "vision_config": {},
              "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out

"""Turn a saved (tiny) HF safetensors checkpoint into an FP8 checkpoint, for loader and end-to-end tests.

    make_fp8_checkpoint(src_dir, dst_dir, fmt="block")       # HF/DeepSeek: weight + weight_scale_inv, 128x128 blocks
    make_fp8_checkpoint(src_dir, dst_dir, fmt="per_tensor")  # compressed-tensors: weight_scale [1] + static input_scale [1]
    make_fp8_checkpoint(src_dir, dst_dir, fmt="per_channel") # compressed-tensors: weight_scale [out, 1], dynamic per-token

Every 2-D `*.weight` of a linear module is quantized, except embeddings, lm_head, norms and MoE routers
(`mlp.gate`), which are listed in the config's ignore list. Static input scales come from a short calibration
forward of the source model through transformers (random token ids, fixed seed), unless `input_amax` is given.
Other files (tokenizer, generation config) are copied unchanged.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kestrel.kernels.fp8_quant import (
    fp8_max,
    quantize_weight_block,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)

FORMATS = ("block", "per_tensor", "per_channel")
DEFAULT_SKIP = ("embed_tokens", "lm_head", "wte", "wpe", "gate")  # module-name components never quantized


def _module_of(tensor_name: str) -> str:
    return tensor_name[: -len(".weight")]


def is_quantizable(name: str, tensor: torch.Tensor, skip=DEFAULT_SKIP) -> bool:
    if not name.endswith(".weight") or tensor.dim() != 2 or not tensor.is_floating_point():
        return False
    last = _module_of(name).rsplit(".", 1)[-1]
    return last not in skip and "norm" not in last


def calibrate_input_amax(src_dir: str | os.PathLike, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, float]:
    """amax of every nn.Linear input over one forward of the source model on random token ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(src_dir)
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def hook(_m, args, _name=mname):
                v = float(args[0].detach().abs().max())
                amax[_name] = max(amax.get(_name, 0.0), v)

            hooks.append(mod.register_forward_pre_hook(hook))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return amax


def _quant_config(fmt: str, ignore: list[str]) -> dict:
    if fmt == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ignore,
        }
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor" if fmt == "per_tensor" else "channel"}
    if fmt == "per_tensor":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    else:
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ignore,
    }


def make_fp8_checkpoint(
    src_dir: str | os.PathLike,
    dst_dir: str | os.PathLike,
    fmt: str = "block",
    input_amax: float | dict[str, float] | None = None,
    skip: tuple[str, ...] = DEFAULT_SKIP,
) -> Path:
    """Write an FP8 copy of the HF checkpoint at `src_dir` into `dst_dir` (created). Returns dst_dir."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    if fmt == "per_tensor" and input_amax is None:
        input_amax = calibrate_input_amax(src)

    ignore: set[str] = {"lm_head"}
    new_names: dict[str, str] = {}  # tensor name -> file, for the index
    for shard in shards:
        tensors = load_file(str(shard))
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not is_quantizable(name, t, skip):
                if name.endswith(".weight") and t.dim() == 2 and "embed" not in name and "norm" not in name:
                    ignore.add(_module_of(name))
                out[name] = t
                continue
            module = _module_of(name)
            if fmt == "block":
                q, s = quantize_weight_block(t, (128, 128))
                out[name], out[f"{module}.weight_scale_inv"] = q, s
            elif fmt == "per_channel":
                q, s = quantize_weight_per_channel(t)
                out[name], out[f"{module}.weight_scale"] = q, s
            else:
                q, s = quantize_weight_per_tensor(t)
                out[name], out[f"{module}.weight_scale"] = q, s.reshape(1)
                amax = input_amax.get(module) if isinstance(input_amax, dict) else input_amax
                if amax is None:
                    raise KeyError(f"no calibrated input amax for {module}")
                out[f"{module}.input_scale"] = torch.tensor([max(amax, 1e-6) / fp8_max()], dtype=torch.float32)
        out = {k: v.contiguous() for k, v in out.items()}
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
        new_names.update({k: shard.name for k in out})

    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    index = src / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text()).get("metadata", {})
        (dst / index.name).write_text(json.dumps({"metadata": meta, "weight_map": new_names}, indent=2))

    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quant_config(fmt, sorted(ignore))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

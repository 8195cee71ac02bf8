"""Random PEFT LoRA adapters saved as real adapter folders, and transformers + PEFT greedy references."""
from __future__ import annotations

from pathlib import Path

import torch

from kestrel.bench.lora_adapters import save_adapter, write_random_adapter as write_adapter

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: Path, out: Path, rank: int, seed: int, targets=ALL_TARGETS, alpha: int | None = None,
                 scale: float = 0.15, model_cls=None, **extra) -> Path:
    """A PEFT adapter with random A and B (PEFT initialises B to zero: such an adapter would change nothing).
    `targets`: module name suffixes, or one regular expression over the full module paths (PEFT's two forms)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = (model_cls or AutoModelForCausalLM).from_pretrained(base_path, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets if isinstance(targets, str)
                     else list(targets), lora_dropout=0.0, bias="none",
                     task_type=None if model_cls else "CAUSAL_LM", **extra)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(out)
    return out


def hf_greedy(base_path: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of transformers (+ PEFT with `adapter`), eos ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            results.append(out[0, len(p):].tolist())
    return results


def write_random_adapter(base_path: Path, out: Path, rank: int, seed: int, targets=ALL_TARGETS,
                         scale: float = 0.1) -> Path:
    """A PEFT-format adapter folder written without peft (the GPU machine may not have it): random A and B (times
    `scale`) for `targets` of every layer of the checkpoint at `base_path`."""
    from transformers import AutoConfig

    return write_adapter(out, AutoConfig.from_pretrained(base_path).to_dict(), rank, seed, targets, scale, scale)


def write_random_adapter_matching(base_path: Path, out: Path, rank: int, seed: int, pattern: str, model_cls,
                                  scale: float = 0.1) -> Path:
    """A PEFT-format adapter folder written without peft for the linear modules of `model_cls` whose full path
    matches `pattern` (as PEFT reads a string target_modules), named as PEFT names them."""
    import re

    model = model_cls.from_pretrained(base_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and re.fullmatch(pattern, name):
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=gen) * scale
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=gen) * scale
    return save_adapter(out, tensors, rank, pattern)


def hf_with_merged_adapter(base_path: Path, adapter: Path, dtype, device: str):
    """transformers with the adapter merged into its weights (W + alpha/r * B A, in float32 before the cast):
    the reference where peft is not installed."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / cfg["r"]
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            modules[name].weight += scaling * (b.float() @ a.float())
    return model.to(device, dtype).eval()

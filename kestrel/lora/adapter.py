"""A PEFT LoRA adapter read from disk (`adapter_config.json` + `adapter_model.safetensors`) and checked against
the model it will serve: targets resolved to our layers (checkpoint names through the model's own renaming, merged
qkv / gate_up take one shard each), rank within --max-lora-rank, the scaling folded into B. Anything we cannot
apply is refused with an error naming it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kestrel.errors import InvalidRequest

# LoRA-capable layers by the part of the model they sit in (a model declares its parts: `lora_stages`)
STAGE_TARGETS = {
    "decoder": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj"),
    "tower": ("q_proj", "k_proj", "v_proj", "qkv_proj", "out_proj", "fc1", "fc2"),  # CLIP / SigLIP encoder layers
    "connector": ("linear_1", "linear_2"),  # LLaVA's projector
}
SUPPORTED_TARGETS = STAGE_TARGETS["decoder"]
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")


class LoRAAdapterError(InvalidRequest):
    """The adapter cannot be served (bad folder, unsupported feature, rank too large, unknown module)."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    # our Linear's name -> per shard (A [rank, in], B [out_shard, rank] with the scaling folded in) or None
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)


def _read_config(folder: Path) -> dict:
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoRAAdapterError(f"{folder} is not a PEFT adapter folder: no adapter_config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise LoRAAdapterError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{cfg_path}: not a JSON object")
    return cfg


def _check_config(cfg: dict, where: str, max_rank: int) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full-weight modules)"),
                      ("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern"),
                      ("layers_to_transform", "layers_to_transform")):
        if cfg.get(key):
            raise LoRAAdapterError(f"{where}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise LoRAAdapterError(f"{where}: fan_in_fan_out adapters are not supported")
    rank = int(cfg.get("r", 0))
    if not 0 < rank <= max_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} is outside 1..--max-lora-rank ({max_rank})")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in targets if any(t.endswith(u) for u in _UNSUPPORTED_TARGETS)]
    if bad:
        raise LoRAAdapterError(f"{where}: LoRA on {bad} (embedding / lm_head, extra vocabulary) is not supported")


def describe_targets(linears: dict, packed: dict[str, tuple[str, ...]]) -> str:
    """The LoRA-capable modules by pattern, as adapters name them: 'model.layers.N.self_attn.(q_proj|k_proj|...)'."""
    leaves: dict[str, list[str]] = {}
    for name in linears:
        parent, leaf = re.sub(r"\.\d+\.", ".N.", name).rsplit(".", 1)
        for m in packed.get(leaf, (leaf,)):
            if m not in leaves.setdefault(parent, []):
                leaves[parent].append(m)
    return ", ".join(f"{p}.({'|'.join(ms)})" if len(ms) > 1 else f"{p}.{ms[0]}" for p, ms in leaves.items())


def _module_name(key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('model.layers.0.self_attn.q_proj', 'A')."""
    name = key.removeprefix("base_model.model.")
    for part in ("lora_A", "lora_B"):
        marker = f".{part}."
        if marker in name:
            return name.split(marker)[0], part[-1]
    raise LoRAAdapterError(f"unexpected tensor {key!r} in the adapter (only lora_A / lora_B weights are supported)")


def _rank_columns(layer, a: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's share of lora_A: the input columns its rank holds (each rank adds x_r A_r^T B^T
    before the layer's all-reduce, which sums them to x A^T B^T). Whole elsewhere."""
    if layer.input_range is None:
        return a
    return a.narrow(1, *layer.input_range).contiguous()


def _rank_rows(layer, b: torch.Tensor, shard: int) -> torch.Tensor:
    """A column-parallel layer's share of one merged shard's lora_B: the output rows its rank holds. Whole
    elsewhere."""
    if layer.output_ranges is None:
        return b.contiguous()
    return b.narrow(0, *layer.output_ranges[shard]).contiguous()


def load_adapter(name: str, path: str, linears: dict, packed: dict[str, tuple[str, ...]], max_rank: int,
                 dtype: torch.dtype, rename=None) -> LoRAAdapter:
    """`linears`: our LoRA-capable Linear layers by name; `packed`: merged module -> the modules it stacks;
    `rename(module)`: the model's name for a checkpoint module path (None: a module the model does not build,
    such as a vision layer past the one the connector reads, whose LoRA cannot change the outputs)."""
    from safetensors.torch import load_file

    folder = Path(path)
    where = f"adapter {name!r} ({path})"
    cfg = _read_config(folder)
    _check_config(cfg, where, max_rank)
    if (folder / "new_embeddings.safetensors").exists():
        raise LoRAAdapterError(f"{where}: extra vocabulary (new_embeddings.safetensors) is not supported")
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise LoRAAdapterError(f"{where}: no adapter_model.safetensors")
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:
        raise LoRAAdapterError(f"{where}: cannot read adapter_model.safetensors ({e})") from e
    rank = int(cfg["r"])
    scaling = cfg.get("lora_alpha", rank) / (rank ** 0.5 if cfg.get("use_rslora") else rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, part = _module_name(key)
        pairs.setdefault(module, {})[part] = t
    member_of = {m: (merged, i) for merged, members in packed.items() for i, m in enumerate(members)}
    adapter = LoRAAdapter(name, str(path), rank)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: {module} lacks lora_{''.join(sorted({'A', 'B'} - set(ab)))}")
        if module.rsplit(".", 1)[-1] in _UNSUPPORTED_TARGETS:
            raise LoRAAdapterError(f"{where}: LoRA on {module.rsplit('.', 1)[-1]} is not supported")
        ours = rename(module) if rename is not None else module
        if ours is None:
            continue
        parent, leaf = ours.rsplit(".", 1)
        if ab["A"].dim() != 2 or ab["B"].dim() != 2:
            raise LoRAAdapterError(f"{where}: {module}'s lora_A / lora_B are not matrices")
        a, b = ab["A"].to(dtype), (ab["B"].float() * scaling).to(dtype)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"{where}: {module} has rank {a.shape[0]}, the config says {rank}")
        if ours in linears:
            target, shard = ours, None
        elif (leaf in member_of and f"{parent}.{member_of[leaf][0]}" in linears
              and member_of[leaf][1] < len(linears[f"{parent}.{member_of[leaf][0]}"].full_output_sizes)):
            target, shard = f"{parent}.{member_of[leaf][0]}", member_of[leaf][1]
        else:  # (a merged layer without that shard, too: Gemma 4's K = V layers have no v_proj)
            raise LoRAAdapterError(f"{where}: module {module} is not a LoRA target of this model (LoRA-capable "
                                   f"modules: {describe_targets(linears, packed)})")
        layer = linears[target]
        full_sizes = layer.full_output_sizes
        if a.shape[1] != layer.full_input_size:
            raise LoRAAdapterError(f"{where}: {module} lora_A takes {a.shape[1]} inputs, the layer has "
                                   f"{layer.full_input_size}")
        a = _rank_columns(layer, a)
        shards = adapter.layers.setdefault(target, [None] * len(full_sizes))
        if shard is None:  # a whole (possibly merged) layer: its B splits over the shards, A is shared
            if b.shape[0] != sum(full_sizes):
                raise LoRAAdapterError(f"{where}: {module} lora_B has {b.shape[0]} outputs, the layer has "
                                       f"{sum(full_sizes)}")
            for i, part in enumerate(b.split(list(full_sizes))):
                shards[i] = (a, _rank_rows(layer, part, i))
        else:
            if b.shape[0] != full_sizes[shard]:
                raise LoRAAdapterError(f"{where}: {module} lora_B has {b.shape[0]} outputs, the layer's shard has "
                                       f"{full_sizes[shard]}")
            shards[shard] = (a, _rank_rows(layer, b, shard))
    if not adapter.layers:
        raise LoRAAdapterError(f"{where}: no LoRA weights in adapter_model.safetensors")
    return adapter

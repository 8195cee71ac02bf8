"""Pooling requests (embeddings, classification and relevance scores) and which pooling task a model serves.

A pooling request is prefill-only: it rides the engine as a one-token request whose last prefill step ends in the
pooler instead of the sampler (kestrel/worker/addons/pooling.py); the one "token" it produces is a placeholder,
its result is the pooled vector, and its KV blocks are freed when it finishes, as any finished request's are.
Decoders (Qwen3-Embedding, *ForSequenceClassification) pool their last token; encoders (BERT, XLM-R) pool the
first token or the mean of all, as their sentence-transformers config says (kestrel/models/pooling.py)."""
from __future__ import annotations

import msgspec

from kestrel.errors import ConfigError

POOLING_TASKS = ("embed", "classify")
EMBED_ARCH_SUFFIX = "Model"  # Qwen3Model, LlamaModel: a decoder saved without its LM head (an embedding model)
CLASSIFY_ARCH_SUFFIX = "ForSequenceClassification"


class PoolingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    task: str = "embed"  # "embed" | "classify" (the engine's task: a request never picks another)
    normalize: bool = True  # embed: L2-normalise (after keeping the first `dimensions`)
    dimensions: int = 0  # embed: keep the first N (Matryoshka models); 0: all
    activation: bool = True  # classify: softmax over the labels (sigmoid for a single label); False: raw logits


def pooling_task(architecture: str, runner: str = "auto", convert: str = "auto") -> str | None:
    """The pooling task a model serves under vLLM's --runner / --convert flags, None for a generative model.
    auto: *ForSequenceClassification classifies, a bare decoder (*Model) embeds; --runner pooling (or --convert
    embed) turns a *ForCausalLM into a last-token embedder."""
    if convert not in ("auto", "none", *POOLING_TASKS):
        raise ConfigError(f"--convert {convert}: only embed and classify are implemented")
    if runner not in ("auto", "generate", "pooling"):
        raise ConfigError(f"--runner {runner}: choose auto, generate or pooling")
    native = ("classify" if architecture.endswith(CLASSIFY_ARCH_SUFFIX)
              else "embed" if architecture.endswith(EMBED_ARCH_SUFFIX) else None)
    if runner == "generate":
        if native or convert in POOLING_TASKS:
            raise ConfigError(f"--runner generate: {architecture} is a pooling model (it has no LM head)"
                              if native else f"--convert {convert} needs --runner pooling (or auto)")
        return None
    if convert in POOLING_TASKS:
        if native and convert != native:
            raise ConfigError(f"--convert {convert}: {architecture} is a{'n' if native == 'embed' else ''} "
                              f"{native} model")
        if convert == "classify" and not native:
            raise ConfigError(f"--convert classify: {architecture} has no classification head (serve a "
                              f"*ForSequenceClassification checkpoint)")
        return convert
    if native:
        return native
    return "embed" if runner == "pooling" else None


def base_architecture(architecture: str) -> str:
    """The generative architecture whose decoder a pooling checkpoint holds (Qwen3ForSequenceClassification,
    Qwen3Model -> Qwen3ForCausalLM)."""
    for suffix in (CLASSIFY_ARCH_SUFFIX, EMBED_ARCH_SUFFIX):
        if architecture.endswith(suffix):
            return architecture[:-len(suffix)] + "ForCausalLM"
    return architecture


def matryoshka_dimensions(hf_config) -> list[int] | None:
    """The output sizes a Matryoshka embedding model was trained for (config.json `matryoshka_dimensions`, or
    `is_matryoshka: true`: any size); None: `dimensions` is refused."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    return [] if getattr(hf_config, "is_matryoshka", False) else None


def num_labels(hf_config) -> int:
    return int(getattr(hf_config, "num_labels", None) or len(getattr(hf_config, "id2label", None) or {}) or 1)


def pooling_facts(model_config, model_options) -> dict | None:
    """What the frontend needs to serve a pooling model (None: a generative one): the task, the class labels,
    the Matryoshka sizes, whether it is an encoder (each prompt one bidirectional prefix) and how it pools. `model_config`: the engine's HFConfig; `model_options`: the ModelConfig (flags)."""
    task = pooling_task(model_config.architecture, model_options.runner, model_options.convert)
    if task is None:
        return None
    hf = model_config.hf
    n = num_labels(hf) if task == "classify" else 0
    id2label = getattr(hf, "id2label", None) or {}
    return {"task": task, "labels": [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n)],
            "matryoshka_dimensions": matryoshka_dimensions(hf), "hidden_size": int(model_config.hidden_size),
            "encoder_only": model_config.encoder_only, "pooling_method": model_config.pooling_method}

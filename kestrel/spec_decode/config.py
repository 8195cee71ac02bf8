"""`speculative_config` as vLLM spells it, checked once at start-up, and the combinations refused there."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from kestrel.errors import ConfigError

METHODS = ("ngram", "mtp", "eagle3", "replay")
RUNNER_METHODS = ("mtp", "eagle3")  # drafted by a draft model in the runner (RunnerDrafts)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # eagle3: the draft checkpoint's folder
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched against the request's own tokens
    prompt_lookup_max: int = 5  # ngram: longest (tried first)
    # no drafts in a step where more requests than this are running (None: always draft); at large batches a
    # decode step is compute-bound and verifying k extra tokens per request costs more than it saves (32:
    # provisional, until benchmarks/spec_decode.py measures the crossover on the H200)
    disable_by_batch_size: int | None = 32
    # replay (benchmarks only): per position, the reference token with probability alpha, else a wrong one
    alpha: float = 1.0
    replay_references: list = field(default_factory=list)  # [[prompt ids, reference output ids], ...]

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a JSON object, not {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if d.get("method") not in METHODS:
            raise ConfigError(f"speculative_config method {d.get('method')!r} is not supported; "
                              f"supported: {', '.join(METHODS)}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ConfigError(f"speculative_config num_speculative_tokens must be an integer in 1..16, not {k!r}")
        cfg = cls(**d)
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ConfigError(f"speculative_config needs 1 <= prompt_lookup_min ({cfg.prompt_lookup_min}) <= "
                              f"prompt_lookup_max ({cfg.prompt_lookup_max})")
        if cfg.disable_by_batch_size is not None and cfg.disable_by_batch_size < 1:
            raise ConfigError(f"speculative_config disable_by_batch_size must be >= 1, not "
                              f"{cfg.disable_by_batch_size}")
        if (cfg.method == "eagle3") != (cfg.model is not None):
            raise ConfigError("speculative_config method 'eagle3' needs \"model\": the EAGLE-3 draft checkpoint's "
                              "folder" if cfg.method == "eagle3" else
                              f"speculative_config \"model\" is for method 'eagle3' only, not {cfg.method!r}")
        if cfg.model is not None and not isinstance(cfg.model, str):
            raise ConfigError(f"speculative_config model must be a path, not {cfg.model!r}")
        if not 0.0 <= cfg.alpha <= 1.0:
            raise ConfigError(f"speculative_config alpha must be in [0, 1], not {cfg.alpha}")
        return cfg

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a request needs past a step's tokens: an EAGLE-3 draft chain writes its layer's K/V at up to
        k - 1 positions after them (kestrel/spec_decode/draft_kv.py)."""
        return self.num_speculative_tokens - 1 if self.method == "eagle3" else 0


def engine_refusals(config) -> list[str]:
    """Features of the engine config that speculative decoding does not support yet (EngineConfig)."""
    out = []
    if config.lora.enable_lora:
        out.append("LoRA (--enable-lora)")
    spec = config.scheduler.speculative_config or {}
    if spec.get("method") in RUNNER_METHODS and config.parallel.tensor_parallel_size > 1:
        out.append(f"method {spec['method']!r} with tensor parallelism (--tensor-parallel-size > 1)")
    return out


def model_refusals(model, kv_cache_groups, method: str = "ngram") -> list[str]:
    """What the loaded model has that speculative decoding does not support yet: image inputs beyond n-gram drafts
    on a causal decoder (a draft model would read image rows' hidden states; a bidirectional prefix is not
    verified), and caches that cannot roll back past rejected drafts (per-request recurrent state). n-gram drafts
    on an image model come after the prompt, so no step verifies image rows."""
    from kestrel.models.interfaces import has_bidirectional_prefix, supports_images

    out = []
    if supports_images(model) and (method in RUNNER_METHODS or has_bidirectional_prefix(model)):
        out.append("image inputs (a multimodal model) other than n-gram drafts on a causal decoder")
    stateful = sorted({type(g.spec).__name__ for g in kv_cache_groups if g.spec.state_parts()})
    if stateful:
        out.append(f"recurrent-state caches ({', '.join(stateful)})")
    return out


def task_refusals(task: str | None) -> list[str]:
    """A pooling model (`task`: kestrel/core/pooling.py's pooling_task) generates no tokens to draft for: refused by
    name rather than ignored."""
    return [f"pooling models (this one serves {task}: a pooling request is one forward, no tokens to draft)"] \
        if task is not None else []


def refuse(what: list[str]) -> None:
    if what:
        raise ConfigError("speculative decoding (speculative_config) does not support " + "; ".join(what)
                          + " yet: start without speculative_config, or without these")

"""Speculative decoding's runner add-ons (kestrel/worker/addons/base.py): `VerifySteps` for every method (refuses
what the loaded model cannot verify, and adds the verify-step CUDA graphs, kestrel/spec_decode/verify_graphs.py),
and `DrafterAddon`, the base of the draft models that draft in the runner (mtp, eagle3;
kestrel/spec_decode/drafters.py): after each forward it keeps the step's captured target hidden states, after each
collect it drafts for the next step, and it binds, profiles and captures its draft model at start-up."""
from __future__ import annotations

from kestrel.models.interfaces import position_scheme
from kestrel.spec_decode.config import RUNNER_METHODS, SpeculativeConfig, model_refusals, refuse
from kestrel.spec_decode.verify_graphs import capture_verify_graphs
from kestrel.worker.addons.base import StepAddon


class VerifySteps(StepAddon):
    name = "verify_steps"
    cfg: SpeculativeConfig

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg

    def bind(self, model, kv_cache_groups, builders, block_rows) -> None:
        refuse(model_refusals(model, kv_cache_groups, self.cfg.method))

    def graph_sets(self, parts, decode_graphs) -> list:
        verify = capture_verify_graphs(parts, self.cfg, decode_graphs)
        return [verify] if verify is not None else []


class DrafterAddon(VerifySteps):
    """A draft model run in the runner (kestrel/spec_decode/drafters.py): the subclass holds `capture` (its
    HiddenCapture) and implements forget, after_step, bind_kv, capture_graphs and profile_forward."""
    name = "drafter"

    def remove_request(self, st) -> None:
        self.forget(st.request_id)

    def after_forward(self, inf, meta, chunks) -> None:
        # the capture's buffer was filled by the forward or the graph replay: the step's rows, copied now
        inf.target_hidden = (self.capture.rows(meta.num_tokens), list(meta.query_start_loc_cpu), chunks)

    def after_collect(self, inf, out, requests) -> None:
        self.after_step(inf, out, requests)

    def bind(self, model, kv_cache_groups, builders, block_rows) -> None:
        super().bind(model, kv_cache_groups, builders, block_rows)
        self.bind_kv(builders, block_rows)

    def graph_sets(self, parts, decode_graphs) -> list:
        sets = super().graph_sets(parts, decode_graphs)
        if decode_graphs is not None:
            self.capture_graphs(decode_graphs.sizes)
        return sets

    def forget(self, rid: str) -> None:
        raise NotImplementedError

    def after_step(self, inf, out, requests) -> None:
        raise NotImplementedError

    def bind_kv(self, builders, block_rows) -> None:
        raise NotImplementedError

    def capture_graphs(self, sizes: list[int]) -> None:
        raise NotImplementedError


def runner_addons(config, loaded, device, dtype, max_step_tokens: int) -> list[StepAddon]:
    """The add-ons of a speculative_config (none without one). Built before the attention binding, so that an
    EAGLE-3 draft's attention layer joins the target's KV group."""
    cfg = SpeculativeConfig.from_dict(config.scheduler.speculative_config)
    if cfg is None:
        return []
    from kestrel.spec_decode.drafters import build_drafter  # its drafters subclass DrafterAddon

    rows = position_scheme(loaded.model, loaded.config.hf).rows
    if cfg.method in RUNNER_METHODS and rows > 1:
        refuse([f"method {cfg.method!r} on a model of {rows} position rows (M-RoPE: the draft layer's rotary reads "
                "token indices; method 'ngram' works)"])
    drafter = build_drafter(cfg, loaded.model, loaded.config.text, loaded.context, loaded.path, device, dtype,
                            max_step_tokens)
    return [drafter if drafter is not None else VerifySteps(cfg)]

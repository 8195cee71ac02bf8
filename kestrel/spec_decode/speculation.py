"""Speculation, an engine add-on: the engine core's side of speculative decoding. Before a synchronous step, which
running requests get drafts and how many, and the acceptance counters (vLLM's vllm:spec_decode_* metrics).

A request is drafted for when all its known tokens but the last are computed (it decodes this step) and its
sampling reads nothing the verify step cannot give per position: no structured outputs (the grammar advances one
token a step) and no per-request logits processors. Drafts are capped so that every emitted token stays within
max_tokens and max_model_len. Speculation is off while more than `disable_by_batch_size` requests run (then the
engine pipelines its steps as without it)."""
from __future__ import annotations

from kestrel.core.engine_addon import EngineAddon
from kestrel.core.step import PLACEHOLDER
from kestrel.core.pooling import pooling_task
from kestrel.spec_decode.config import SpeculativeConfig, engine_refusals, refuse, task_refusals
from kestrel.spec_decode.proposers import make_proposer

# sampling fields whose logits processing is applied per request, not per output position: no drafts for them
_PER_REQUEST_LOGITS = ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words", "logits_processors")


def draftable(req) -> bool:
    sp = req.sampling_params
    if req.num_computed_tokens != req.num_tokens - 1 or req.grammar is not None:
        return False
    if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
        return False
    return not any(getattr(sp, name, None) for name in _PER_REQUEST_LOGITS)


class Speculation(EngineAddon):
    """Its steps are synchronous: drafts are proposed from every known token."""
    name = "speculation"

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, seed: int = 0, num_running=lambda: 0):
        self.cfg = cfg
        self.lookahead_slots = cfg.num_lookahead_slots
        self._num_running = num_running  # () -> the scheduler's running count
        self.k = cfg.num_speculative_tokens
        self.proposer = make_proposer(cfg, seed)
        self.max_model_len = max_model_len
        # cumulative counters
        self.num_drafts = 0  # verify steps of one request
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # drafts accepted at position 0, 1, ...

    @classmethod
    def check_config(cls, config) -> None:
        if config.scheduler.speculative_config is not None:
            SpeculativeConfig.from_dict(config.scheduler.speculative_config)
            refuse(engine_refusals(config))  # before the model loads

    @classmethod
    def build(cls, core) -> "Speculation | None":
        cfg = SpeculativeConfig.from_dict(core.config.scheduler.speculative_config)
        if cfg is None:
            return None
        m = core.config.model
        refuse(task_refusals(pooling_task(core.model_config.architecture, m.runner, m.convert)))
        return cls(cfg, core.max_model_len, core.config.model.seed, lambda: core.scheduler.num_running)

    def allows_pipelining(self) -> bool:
        return not self.active(self._num_running())

    def propose(self, running: list) -> dict[str, list[int]]:
        """Drafts per request id for the next step (none while more than disable_by_batch_size run)."""
        return self._drafts(running) if self.active(len(running)) else {}

    def after_collect(self, sched, result, pending) -> None:
        self.record(sched.scheduled, result.more_sampled, result.next_drafts)

    def stats(self, s) -> None:
        s.spec_num_drafts, s.spec_num_draft_tokens = self.num_drafts, self.num_draft_tokens
        s.spec_num_accepted_tokens = self.num_accepted_tokens
        s.spec_accepted_per_pos = list(self.accepted_per_pos)

    def active(self, num_running: int) -> bool:
        limit = self.cfg.disable_by_batch_size
        return limit is None or num_running <= limit

    def _drafts(self, running: list) -> dict[str, list[int]]:
        """Drafts per request id for the next step, from the running requests (all tokens known)."""
        self.proposer.retain({r.request_id for r in running})
        reqs, caps = [], []
        for r in running:
            cap = min(self.k, r.max_tokens - len(r.output_token_ids) - 1, self.max_model_len - r.num_tokens - 1)
            if cap > 0 and draftable(r):
                reqs.append(r)
                caps.append(cap)
        if not reqs:
            return {}
        drafts = self.proposer.propose([r.request_id for r in reqs], reqs, caps)
        return {r.request_id: d for r, d in zip(reqs, drafts) if d}

    def record(self, scheduled: list, more_sampled: dict[str, list[int]],
               next_drafts: dict[str, tuple[int, list[int]]] | None = None) -> None:
        """Count a finished step's drafts and accepted drafts (`scheduled`: its ScheduledRequests); keep the drafts
        the runner made for the next step (methods mtp, eagle3)."""
        if next_drafts:
            self.proposer.receive(next_drafts)
        for s in scheduled:
            if not s.proposed_token_ids:
                continue
            accepted = len(more_sampled.get(s.request.request_id, ()))
            self.num_drafts += 1
            self.num_draft_tokens += len(s.proposed_token_ids)
            self.num_accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_pos[j] += 1

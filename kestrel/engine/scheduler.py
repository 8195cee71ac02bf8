"""Token-budget continuous batching. Each step spends at most `max_num_batched_tokens`: running requests
first (decodes, then ongoing chunked prefills), then waiting ones in FCFS or priority order. When the KV pool
runs dry, the lowest-priority running request is preempted and later recomputed (its output is kept), from its
prefix-cache hits (or a KV tier's copy of its blocks: KVCacheManager.preempt) on.

Every request carries `num_computed_tokens`; a step schedules `num_tokens - num_computed_tokens` of it (capped
by the budget), so prefill, chunked prefill, decode and recompute after preemption are one rule.

Fair share between request groups (kestrel/engine/fair_share.py): while more than one API request has work, a
group's running sequences beyond its cap sit steps out, and are the first preempted where a newcomer needs room."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from kestrel.config import SchedulerConfig
from kestrel.core.step import NewRequestData, ScheduledChunk, StepInput
from kestrel.engine.fair_share import FairShare
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.request import PLACEHOLDER, Request, RequestStatus
from kestrel.engine.waiting_queue import WaitingQueue


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    output_index: int = -1  # where this step's sampled token goes in output_token_ids (set at launch)
    samples: bool = False  # this step reaches the end of the known tokens, so a new token is sampled
    # tokens proposed past the known ones (speculative decoding's drafts), computed as the last of num_new_tokens
    # and verified by the step's sampling
    proposed_token_ids: list[int] = field(default_factory=list)
    num_emitted: int = 1  # tokens the step's result appended (more than one where proposed ones were accepted)

    def __post_init__(self):
        known = self.num_new_tokens - len(self.proposed_token_ids)
        self.samples = self.num_computed_tokens + known == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """The engine's view of a step (live requests), and `step`: the deltas the model runner receives."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # aborted/finished since the last step
    # finished "length" here: alone with the pool to itself, they could not take their next step (a KV pool
    # smaller than max_model_len); the engine reports them (without them the queue waited behind them for good)
    cut: list[Request] = field(default_factory=list)
    step: StepInput = field(default_factory=StepInput)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def needs_sync(req: Request) -> bool:
    """Sampling that reads previous tokens' values on the host (penalties, multi-token bad words), or logprobs
    (read on the host each step)."""
    p = req.sampling_params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
            or p.logprobs is not None or p.prompt_logprobs is not None or p.bans_after_prefix)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, lookahead: int = 0,
                 gates: list = ()):
        """`lookahead`: KV slots each request holds past a step's tokens. `gates`: can_schedule(req, running)
        callables (the engine add-ons'): a waiting request joins the running ones only where all say yes."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.lookahead = lookahead
        self.gates = list(gates)
        # the one admission rule: the engine announces this number, the frontend compares prompts against it
        self.max_prompt_tokens = kv.max_prompt_tokens(config.max_num_batched_tokens, max_model_len)
        if not config.enable_chunked_prefill:  # a prompt is then computed in one step
            self.max_prompt_tokens = min(self.max_prompt_tokens, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_sync_requests = 0  # live requests that rule out pipelined decode (see needs_sync)
        self.fair = FairShare(config.contended_running_cap())

    # ---- requests in and out
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.num_prompt_tokens > self.max_prompt_tokens:
            raise ValueError(f"prompt of {req.num_prompt_tokens} tokens does not fit the KV cache (at most "
                             f"{self.max_prompt_tokens} tokens)")
        req.extras.check_step_budget(self.config.max_num_batched_tokens)
        self.requests[req.request_id] = req
        self.fair.joined(req)
        if needs_sync(req):
            self.num_sync_requests += 1
        self.waiting.push(req)

    def abort_requests(self, request_ids) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            self._finish(req)
            aborted.append(req)
        return aborted

    def _finish(self, req: Request) -> None:
        if needs_sync(req):
            self.num_sync_requests -= 1
        self.kv.free(req)
        if self.requests.pop(req.request_id, None) is not None:
            self.fair.left(req)
        self._finished_ids.append(req.request_id)
        req.num_sent_blocks = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step
    def _priority_key(self, r: Request):
        if self.config.scheduling_policy == "priority":
            return (r.priority, r.arrival_time)
        return (0, r.arrival_time)

    def recompute(self, req: Request) -> None:
        """Compute a running request again from its first token, now: the KV it read in the step just collected
        is wrong (a KV tier's load failed). Its blocks go back, the runner forgets it with the next step, it waits
        at the front of the queue, and its placeholders go (the caller drops the step's tokens)."""
        if req not in self.running:
            return
        self.running.remove(req)
        self.kv.free(req)
        while req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
            req.output_token_ids.pop()
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_cached_tokens = -1  # measured again when it is scheduled
        req.num_sent_blocks = None
        self.waiting.push_front(req)
        self._finished_ids.append(req.request_id)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.preempt(req)  # a KV tier may offload its blocks (resumed from there rather than recomputed)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)
        out.preempted.append(req)
        req.num_sent_blocks = None  # the runner drops it; a resume sends it anew

    def schedule(self, proposed: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """`proposed` (speculative decoding's drafts): tokens per running request whose known tokens are all
        computed but the last; they count in the token budget and are verified by the step's sampling."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        cap = self.fair.cap()
        paused = self.fair.paused(self.running, cap)  # least computed first: the first to preempt
        paused_ids = {r.request_id for r in paused}

        # 1. running requests: decodes first, then ongoing prefill chunks
        for req in sorted(self.running, key=lambda r: r.in_prefill):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING or req.request_id in paused_ids:
                continue  # preempted earlier in this loop, or over its group's share
            if len(req.output_token_ids) >= req.max_tokens:
                continue  # its in-flight token is its last one
            num_new = self._chunk(req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            extra = proposed.get(req.request_id, ())[:budget - num_new] if proposed else []
            num_new += len(extra)
            lookahead = self._lookahead(req.num_computed_tokens + num_new)
            while True:
                if self.kv.allocate_slots(req, num_new, lookahead=lookahead):
                    out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens,
                                                          proposed_token_ids=extra))
                    scheduled_ids.add(req.request_id)
                    budget -= num_new
                    break
                if extra:  # drafts are optional: the step without them first
                    num_new -= len(extra)
                    extra = []
                    lookahead = self._lookahead(req.num_computed_tokens + num_new)
                    continue
                if paused:  # a sequence over its group's share gives way first
                    self._preempt(paused.pop(0), out)
                    continue
                victims = [r for r in self.running if r is not req and r.request_id not in scheduled_ids]
                victim = max(victims, key=self._priority_key) if victims else req
                if victim is req and len(self.running) == 1:
                    self._cut(req, out)  # the pool to itself and no room: preempted, it would wait for ever
                    break
                if victim is req or self._priority_key(victim) < self._priority_key(req):
                    self._preempt(req, out)  # nobody of lower priority left to evict: step back ourselves
                    break
                self._preempt(victim, out)

        # 2. waiting requests, while budget, sequence slots and blocks last and the gates let them in; under a
        # share, a paused sequence is preempted where a newcomer needs its slot or blocks
        kv_short = bool(out.preempted)
        gates = self.gates
        running_per_group = Counter(r.group for r in self.running) if cap is not None else None
        while not kv_short and budget > 0:
            req = self.fair.next_waiting(self.waiting, running_per_group, cap)
            if req is None:
                break
            if gates and not all(gate(req, self.running) for gate in gates):
                break  # it waits for what running requests hold (e.g. an adapter's device slot)
            if len(self.running) >= self.config.max_num_seqs:
                if not paused:
                    break
                self._preempt_paused(paused, running_per_group, out)
                continue  # the preempted sequence waits at the front now: look again
            computed, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if num_new > budget:
                # a bidirectional prefix is one chunk: its first tokens attend to its last ones
                if not self.config.enable_chunked_prefill or num_hit + budget < req.extras.bidirectional_len:
                    break
                num_new = budget
            num_new = self._chunk(num_hit, num_new)
            if not self.kv.allocate_slots(req, num_new, computed, self._lookahead(num_hit + num_new)):
                if not paused:
                    if not self.running and req.output_token_ids:  # a preempted request the pool cannot hold
                        self._cut(req, out)
                        continue
                    break
                self._preempt_paused(paused, running_per_group, out)
                continue
            self.waiting.take(req)
            if running_per_group is not None:
                running_per_group[req.group] += 1
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, num_hit))
            budget -= num_new
        out.step = self._step_input(out)
        return out

    def _lookahead(self, end: int) -> int:
        """Slots to hold past a step that ends at `end` tokens (the `lookahead` slots), not past max_model_len."""
        return max(0, min(self.lookahead, self.max_model_len - end))

    def _chunk(self, start: int, num_new: int) -> int:
        """Tokens of a chunk after `start`: cut at a block boundary where the cache keeps state snapshots only
        at chunk ends (KVCacheManager.aligned_chunk); whole when chunked prefill is off."""
        return self.kv.aligned_chunk(start, num_new) if self.config.enable_chunked_prefill else num_new

    def _cut(self, req: Request, out: SchedulerOutput) -> None:
        """Finish `req` "length": its context has outgrown what the KV pool holds for one request (the pool is
        smaller than max_model_len); the tokens it has are all sent."""
        while req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
            req.output_token_ids.pop()
        self._remove(req)
        req.status = RequestStatus.FINISHED_LENGTH
        self._finish(req)
        out.cut.append(req)

    def _preempt_paused(self, paused: list[Request], running_per_group: Counter, out: SchedulerOutput) -> None:
        """Make room for a newcomer: preempt the paused sequence with the least computed work."""
        victim = paused.pop(0)
        self._preempt(victim, out)
        running_per_group[victim.group] -= 1

    def _step_input(self, out: SchedulerOutput) -> StepInput:
        """The runner's deltas: new (or resumed) requests in full, block ids appended since each request's last
        step (looked at only for requests whose blocks grew), and every request the runner should forget
        (finished, aborted or preempted)."""
        step = StepInput(finished_ids=out.finished_ids + [r.request_id for r in out.preempted])
        grown = self.kv.grown
        for s in out.scheduled:
            req = s.request
            new_ids = None
            if req.num_sent_blocks is None:
                if not req.scheduled_at:
                    req.scheduled_at = time.monotonic()
                block_ids = self.kv.block_ids(req)
                sp = req.sampling_params
                stop = ([req.eos_token_id] if req.eos_token_id is not None and not sp.ignore_eos else [])
                step.new_requests.append(NewRequestData(
                    req.request_id, req.prompt_token_ids, [t for t in req.output_token_ids if t != PLACEHOLDER], sp,
                    stop + list(sp.stop_token_ids), [list(ids) for ids in block_ids], req.extras))
                req.num_sent_blocks = [len(ids) for ids in block_ids]
            elif req.request_id in grown:
                block_ids = self.kv.block_ids(req)
                new_ids = [ids[n:] for ids, n in zip(block_ids, req.num_sent_blocks)]
                req.num_sent_blocks = [len(ids) for ids in block_ids]
            grown.discard(req.request_id)
            step.chunks.append(ScheduledChunk(req.request_id, s.num_new_tokens, s.num_computed_tokens, s.samples,
                                              new_ids, s.proposed_token_ids))
        step.chunks.sort(key=lambda c: c.num_new_tokens != 1)  # the runner's row order: decode rows first
        step.state_restores, step.state_saves = self.kv.take_state_copies()
        step.kv_connector_meta = self.kv.build_connector_meta()
        return step

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           more_sampled: dict[str, list[int]] | None = None) -> list[Request]:
        """Synchronous step: the launch bookkeeping and the result at once. Returns the finished requests."""
        self.on_launch(out)
        return self.on_result(out, sampled, more_sampled)

    def on_launch(self, out: SchedulerOutput) -> None:
        """The step's work is queued: advance computed counts and give each sampling request a placeholder
        token, so the next step can be scheduled before this one's tokens are known (pipelined decode)."""
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue
            # proposed tokens are computed but not yet known to be right: the result counts the accepted ones
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens - len(s.proposed_token_ids)
            if s.samples:
                s.output_index = len(req.output_token_ids)
                req.output_token_ids.append(PLACEHOLDER)

    def on_result(self, out: SchedulerOutput, sampled: dict[str, int],
                  more_sampled: dict[str, list[int]] | None = None) -> list[Request]:
        """Fill the placeholders with the sampled tokens, check stop conditions, cache full blocks.
        A request that already finished (or was aborted) while this step ran is skipped. `more_sampled`: the
        tokens a verify step emitted after the first (accepted drafts, then the target's own; never pipelined,
        so no placeholder follows): each is checked for a stop in turn, and the computed count covers the
        accepted drafts (the rejected ones' KV slots are overwritten later)."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            token = sampled.get(req.request_id)
            if token is not None and s.output_index >= 0:
                more = more_sampled.get(req.request_id, ()) if more_sampled else ()
                stopped = False
                for i, tok in enumerate((token, *more)):
                    if i:
                        req.output_token_ids.append(tok)
                    else:
                        req.output_token_ids[s.output_index] = tok
                    s.num_emitted = i + 1
                    if self._check_stop(req, tok, s.output_index + 1 + i):
                        stopped = True
                        break
                req.num_computed_tokens += s.num_emitted - 1
                if stopped:
                    del req.output_token_ids[s.output_index + s.num_emitted:]  # a placeholder of a step in flight
                    self.kv.cache_full_blocks(req)  # what this last step computed serves later prompts too
                    self._remove(req)
                    self._finish(req)
                    finished.append(req)
                    continue
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(req)  # tokens before num_computed are all filled by now
        return finished

    def _remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def _check_stop(self, req: Request, token: int, n_out: int) -> bool:
        sp = req.sampling_params
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in sp.stop_token_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
                return True
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

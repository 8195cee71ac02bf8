"""The engine core's start-up and output assembly, kept out of EngineCore: the executor with its KV cache, and a
collected step's EngineCoreOutputs (per scheduled request its new tokens, more than one after a verify step,
logprobs, finish and timing) with the step's token counts for the statistics."""
from __future__ import annotations

import logging
import time

from kestrel.engine.messages import EngineCoreOutput, SchedulerStats
from kestrel.executor import make_executor

logger = logging.getLogger("kestrel.engine.core")


def start_executor(config, progress: bool):
    """The executor (it loads the model) with its KV cache allocated, and the number of blocks; the executor is
    shut down where a later stage fails."""
    ex = make_executor(config, progress)
    try:
        num_blocks = ex.start_up()  # precompile, size the KV cache, allocate it, warm up and capture graphs
    except BaseException:
        ex.shutdown()
        raise
    return ex, num_blocks


def step_outputs(sched, result, finished: set[str], outputs: list[EngineCoreOutput]) -> tuple[int, int]:
    """Append the outputs of `sched` (a SchedulerOutput) from `result` (its RunnerOutput) to `outputs`; `finished`:
    the ids the scheduler finished with this result. Returns (prompt tokens computed, tokens generated)."""
    for s in sched.scheduled:
        req = s.request
        rid = req.request_id
        if req.is_finished and rid not in finished:
            continue  # finished or aborted while this step was in flight
        tok = result.sampled.get(rid)
        plp = result.prompt_logprobs.get(rid)
        if tok is None and plp is None:
            continue
        lp = result.logprobs.get(rid)
        new, lps = ([tok] if tok is not None else []), ([lp] if lp is not None else None)
        if rid in result.more_sampled:  # a verify step: the tokens kept (a stop may have cut the rest)
            new += result.more_sampled[rid][:s.num_emitted - 1]
            if lps is not None:
                lps += result.more_logprobs[rid][:s.num_emitted - 1]
        outputs.append(EngineCoreOutput(
            rid, new, new_logprobs=lps, prompt_logprobs=plp,
            finish_reason=req.status.value if rid in finished else None,
            stop_reason=req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0),
            scheduled_at=req.scheduled_at if tok is not None and s.output_index == 0 else 0.0))
    prompt_tokens = sum(max(0, min(s.num_computed_tokens + s.num_new_tokens, s.request.num_prompt_tokens)
                            - s.num_computed_tokens) for s in sched.scheduled)
    generated = sum(len(o.new_token_ids) for o in outputs)  # a verify step emits several tokens a request
    return prompt_tokens, generated


def scheduler_stats(scheduler, kv, step_prompt_tokens: int, step_generation_tokens: int) -> SchedulerStats:
    return SchedulerStats(scheduler.num_running, scheduler.num_waiting, kv.usage, kv.num_blocks, kv.num_free_blocks,
                          kv.prefix_queries, kv.prefix_hits, scheduler.num_preemptions,
                          num_paused_steps=scheduler.fair.num_paused_steps, step_prompt_tokens=step_prompt_tokens,
                          preempted_prefix_queries=kv.preempted_queries, preempted_prefix_hits=kv.preempted_hits,
                          step_generation_tokens=step_generation_tokens)


def log_ready(executor, scheduler, num_blocks: int, block_size: int, t0: float) -> None:
    if scheduler.max_prompt_tokens < scheduler.max_model_len - 1:
        logger.warning("the KV cache admits prompts of at most %d tokens (max_model_len %d): longer ones are "
                       "refused", scheduler.max_prompt_tokens, scheduler.max_model_len)
    dtypes = sorted({str(g.spec.dtype).removeprefix("torch.") for g in executor.kv_cache_groups})
    logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); ready in %.1f s", num_blocks,
                block_size, num_blocks * block_size, num_blocks * executor.bytes_per_block / 2**20, "/".join(dtypes),
                time.perf_counter() - t0)

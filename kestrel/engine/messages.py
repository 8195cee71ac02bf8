"""What the engine core takes and gives: a request to add, and per step the outputs of its requests with the
scheduler's statistics. msgspec structs: the IPC layer (kestrel/ipc/protocol.py) encodes them on the wire, never
pickle; in-process they are passed as they are."""
from __future__ import annotations

from typing import Any

import msgspec

from kestrel.core.extras import NO_EXTRAS, RequestExtras
from kestrel.core.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0
    extras: RequestExtras = NO_EXTRAS  # per-request features: adapter, images, attention-mask policy, cache salt
    # the API request this sequence belongs to (its prompts x n share it): the scheduler's per-group running cap
    # while other groups have work ("": a group of its own)
    group_id: str = ""


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    # per new token: (logprob, rank, [[token, logprob], ...])
    new_logprobs: list | None = None
    # per prompt position 1..: (token, logprob, rank, [[token, logprob], ...])
    prompt_logprobs: list | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's result (its one token is a placeholder)
    scheduled_at: float = 0.0  # with a request's first token: when it was first scheduled (time.monotonic())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_paused_steps: int = 0  # steps in which a request group's sequences beyond its fair share sat out
    # speculative decoding (cumulative): verify steps of one request, drafted tokens, accepted ones, accepted
    # drafts per position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # the host KV tier (--kv-offloading-size): blocks held, its slots, blocks saved and loaded (cumulative)
    host_kv_blocks: int = 0
    host_kv_slots: int = 0
    host_kv_saved_blocks: int = 0
    host_kv_loaded_blocks: int = 0
    host_kv_saved_bytes: int = 0
    host_kv_loaded_bytes: int = 0
    # prompt tokens looked up in the KV tiers past the device's hit, and served from them (tokens, cumulative)
    tier_kv_queries: int = 0
    tier_kv_hits: int = 0
    # the disk tier (--kv-offloading-disk-path): files held and their bytes, blocks written and read (cumulative)
    disk_kv_blocks: int = 0
    disk_kv_bytes: int = 0
    disk_kv_written_blocks: int = 0
    disk_kv_read_blocks: int = 0
    disk_kv_written_bytes: int = 0
    disk_kv_read_bytes: int = 0
    # preemptions whose blocks the host tier took (held until the request resumed), or left to be recomputed
    host_kv_preempt_offloads: int = 0
    host_kv_preempt_recomputes: int = 0
    # requests resumed after a preemption (cumulative, vLLM's PrefixCacheStats.preempted_*): their tokens when
    # admitted again, and of them those served from the prefix cache or a KV tier (the rest is computed again)
    preempted_prefix_queries: int = 0
    preempted_prefix_hits: int = 0
    kv_transfer_failures: int = 0  # KV tier copies that failed (their entries dropped, their readers recomputed)
    # the step these stats come with (0 where none was collected): prompt tokens computed (prefix-cache hits
    # excluded) and tokens sampled
    step_prompt_tokens: int = 0
    step_generation_tokens: int = 0
    # LoRA (engine/addons/lora.py, with --enable-lora): the adapters of the running and of the waiting requests
    running_loras: list[str] = []
    waiting_loras: list[str] = []

    @property
    def kv_loaded_bytes(self) -> int:
        """Bytes loaded into the device from every KV tier."""
        return self.host_kv_loaded_bytes + self.disk_kv_read_bytes

    @property
    def step_tokens(self) -> int:
        return self.step_prompt_tokens + self.step_generation_tokens

    def as_dict(self) -> dict:
        return msgspec.structs.asdict(self)


class UtilityOutput(msgspec.Struct, omit_defaults=True):
    call_id: int
    ok: bool = True
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    # the engine core's last message before it exits on a failed step (a tensor-parallel worker died): why
    engine_error: str | None = None
    # a liveness heartbeat (sent about once a second from a thread of the engine-core process): the number of
    # steps the engine has finished so far, and the work it has done (kestrel/core/progress.py: module forwards on
    # the CPU), which moves while a long step runs
    heartbeat: int | None = None
    work: int = 0

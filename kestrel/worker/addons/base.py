"""The interface of a runner add-on: one per-request feature's part of each step (kestrel/worker/addons/*.py).

The runner knows no feature by name: it calls each hook of every add-on that overrides it, in the order the
add-ons were built. A request's features reach an add-on once, when the request arrives (`add_request`: its
`RequestState.extras`); nothing is copied per step. An add-on owns its CUDA-graph rules: `supports_graphs()` is
asked once before capture (False: no graphs at all), `step_graph_ok()` each step after its hooks ran (False:
this step runs eagerly)."""
from __future__ import annotations

import torch

from kestrel.core.step import ScheduledChunk
from kestrel.worker.input_batch import RequestState

# the hooks the runner calls through per-hook lists: per step, then at start-up (supports_graphs and warm_up are
# asked of every add-on once)
HOOKS = ("add_request", "remove_request", "prepare", "failed_requests", "attention_fields", "inputs_embeds",
         "step_graph_ok", "before_sample", "pool", "after_forward", "after_collect",
         "bind", "graph_sets", "profile_forward")


class StepAddon:
    # attention-backend capability flags this add-on's feature needs (the selector skips backends without them)
    backend_requires: tuple[str, ...] = ()
    name: str = ""  # the runner's attribute for it (runner.<name>), where it has one
    names: set[str] = set()  # every add-on class's name: runner.<name> is None where no such add-on was built

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.name:
            StepAddon.names.add(cls.name)

    def add_request(self, st: RequestState) -> None:
        """A request the runner starts tracking (new, or resumed after a preemption)."""

    def remove_request(self, st: RequestState) -> None:
        """A request the runner forgets (finished, aborted, preempted, or replaced on resumption)."""

    def prepare(self, chunks: list[ScheduledChunk], states: list[RequestState]) -> None:
        """Host-side staging of a step (batch order, decodes first), before its inputs go to the device."""

    def failed_requests(self, chunks: list[ScheduledChunk], states: list[RequestState]) -> dict[str, str]:
        """Requests of this step the feature could not serve (request id -> why): the engine ends them as
        "abort" with that reason and the other requests go on."""
        return {}

    def attention_fields(self, chunks: list[ScheduledChunk], states: list[RequestState]) -> dict:
        """Extra fields of the step's CommonAttentionMetadata (e.g. an attention-mask policy's per-row lengths)."""
        return {}

    def inputs_embeds(self, chunks: list[ScheduledChunk], states: list[RequestState],
                      input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings where the add-on replaces rows (None: the model embeds the ids)."""
        return None

    def step_graph_ok(self) -> bool:
        """May this step replay a decode CUDA graph (asked after the step's other hooks)?"""
        return True

    def supports_graphs(self) -> bool:
        """May decode CUDA graphs be captured at all?"""
        return True

    def before_sample(self, logits: torch.Tensor, inf) -> None:
        """Change a launched step's logits (rows in `inf.rows` order) in place before sampling."""

    def pool(self, chunks: list[ScheduledChunk], states: list[RequestState], hidden: torch.Tensor,
             query_start_loc: list[int]) -> dict[str, list[float]]:
        """Rows this add-on ends instead of the sampler (a pooling request's last prefill step): request id ->
        its pooled vector, from the step's final hidden states (rows b of query_start_loc[b]:[b + 1])."""
        return {}

    def after_forward(self, inf, meta, chunks: list[ScheduledChunk]) -> None:
        """After a launched step's forward or graph replay (`meta`: its first group's attention metadata)."""

    def after_collect(self, inf, out, requests: dict[str, RequestState]) -> None:
        """A launched step's RunnerOutput was collected (e.g. a drafter drafts for the next step into it)."""

    # ---- start-up
    def bind(self, model, kv_cache_groups, builders, block_rows) -> None:
        """Once the attention layers are bound to KV groups (and the block-table rows exist)."""

    def graph_sets(self, parts, decode_graphs) -> list:
        """After the decode CUDA graphs were captured (`parts`: what graph sets are built from): the graph sets this
        add-on adds to those that serve steps (GraphSet, kestrel/worker/cuda_graphs.py), captured."""
        return []

    def profile_forward(self, ids, positions, ctx) -> None:
        """After the memory profile's forward: run what a step adds to it (a draft model's first forward)."""

    def warm_up(self) -> object:
        """Start-up: run what the first requests would otherwise compile or allocate (the memory profile keeps
        the returned object alive through its forward)."""
        return None


def overriding(addons: list[StepAddon], hook: str) -> list:
    """The bound `hook` methods of the add-ons that override it: the runner's per-step loops skip the rest."""
    return [getattr(a, hook) for a in addons if getattr(type(a), hook) is not getattr(StepAddon, hook)]

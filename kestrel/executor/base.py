"""The executor: what the engine core drives the model through. One implementation runs the model runner in the
engine's own process (uni); the others run one worker per tensor-parallel rank (mp: local processes, ray: Ray
actors) and broadcast every step to all of them."""
from __future__ import annotations

import torch

from kestrel.core.kv_spec import KVCacheGroup
from kestrel.core.step import StepInput


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the executor is dead after it (the engine reports dead)."""


class Executor:
    model_config: "object"  # HFConfig
    tokenizer: object
    device: torch.device
    kv_cache_groups: list[KVCacheGroup]
    bytes_per_block: int
    runner = None  # the in-process ModelRunner (uni only)

    def precompile_kernels(self) -> None:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every rank (the minimum over ranks)."""
        raise NotImplementedError

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and set up what needs it (buffers, CUDA graphs) on every rank."""
        raise NotImplementedError

    def launch(self, step: StepInput, prev=None, sample: bool = True, before_forward=None):
        """Start a step and return a handle for `collect` (its `samples` says whether it samples tokens). With
        sample=False the caller passes a token bitmask to `sample` first (handle.rows: request id -> its row).
        `before_forward()` is called once the step's inputs are staged, before its forward is queued: where
        `prev` has not sampled yet (its bitmask was filling), the caller samples it there."""
        raise NotImplementedError

    def sample(self, handle, bitmask=None) -> None:
        raise NotImplementedError

    def collect(self, handle):
        """The RunnerOutput of a launched step, in launch order."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise WorkerError when a worker is gone."""

    def shutdown(self) -> None:
        pass


class UniExecutor(Executor):
    """Today's fast path: the model runner in the engine process."""

    def __init__(self, config, progress: bool = True):
        from kestrel.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config, progress)
        self.model_config = self.runner.model_config
        self.tokenizer = self.runner.loaded.tokenizer
        self.device = self.runner.device
        self.kv_cache_groups = self.runner.kv_cache_groups

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    def precompile_kernels(self) -> None:
        self.runner.precompile_kernels()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.setup_after_kv()

    def launch(self, step: StepInput, prev=None, sample: bool = True, before_forward=None):
        return self.runner.launch(step, prev, sample, before_forward)

    def sample(self, handle, bitmask=None) -> None:
        self.runner.sample(handle, bitmask)

    def collect(self, handle):
        return self.runner.collect(handle)

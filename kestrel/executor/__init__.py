"""How the engine core runs the model: in its own process (uni) or over tensor-parallel workers (mp, ray)."""
from __future__ import annotations

from kestrel.errors import ConfigError
from kestrel.executor.base import ControlCallError, Executor, UniExecutor, WorkerError


def executor_backend(config) -> str:
    par = config.parallel
    if par.tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be at least 1, got {par.tensor_parallel_size}")
    backend = par.distributed_executor_backend or ("uni" if par.tensor_parallel_size == 1 else "mp")
    if backend == "uni" and par.tensor_parallel_size > 1:
        raise ConfigError("--distributed-executor-backend uni runs one process: use mp or ray for "
                          f"--tensor-parallel-size {par.tensor_parallel_size}")
    return backend


def make_executor(config, progress: bool = True) -> Executor:
    backend = executor_backend(config)
    if backend == "uni":
        return UniExecutor(config, progress)
    if backend == "mp":
        from kestrel.executor.multiproc import MPExecutor

        return MPExecutor(config, progress)
    if backend == "ray":
        from kestrel.executor.ray_executor import RayExecutor

        return RayExecutor(config, progress)
    raise ConfigError(f"unknown --distributed-executor-backend {backend!r} (uni, mp or ray)")


__all__ = ["ControlCallError", "Executor", "UniExecutor", "WorkerError", "executor_backend", "make_executor"]

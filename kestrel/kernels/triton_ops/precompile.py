"""Parallel ahead-of-time compilation of the Triton kernels that start-up needs.

A cold start (empty Triton cache) otherwise compiles ~20 kernel variants one after another, each ~0.5 s of
MLIR passes, ptxas and a gcc-built launcher, inside the profile run and the CUDA-graph capture. Here the engine
runs the same forwards once in *compile-only* mode: every Triton launch becomes a `warmup` (compile, do not run)
submitted to a thread pool through `triton.AsyncCompileMode`; the MLIR passes, ptxas and gcc release the GIL,
so the variants compile side by side. Leaving the mode waits for all of them and fills each kernel's in-memory
cache, so the real runs that follow find every variant compiled. Torch ops in those forwards run normally on
whatever the skipped kernels left in their outputs (the values are never used). That is safe while Triton
outputs are data (activations, attention, norms); a kernel whose output becomes indices for a torch op must
leave valid values in this mode (ask `compiling_only()`), or an out-of-range index trips a device assert. The
fused MoE keeps that rule: the fused softmax router allocates its ids zeroed here (a torch lookup by expert id,
Gemma 4's per_expert_scale, follows it), and the Triton layout kernel (sorted ids, block -> expert) feeds only
its Triton GEMMs (kernels/triton_ops/fused_moe.py; tests/gpu/test_gpu_moe.py runs MoE blocks here on NaN inputs).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import triton
from triton import knobs
from triton.runtime.jit import JITFunction

logger = logging.getLogger(__name__)


class CompileCounter:
    """Counts Triton compilations (the post-compile hook fires once per new variant, async ones included)."""

    def __init__(self):
        self.count = 0
        self._prev = None

    def __enter__(self):
        self._prev = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.count += 1
            return self._prev(*args, **kwargs) if self._prev is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc):
        knobs.runtime.jit_post_compile_hook = self._prev


class _CompileAndLinkPool(ThreadPoolExecutor):
    """A compile job also builds the kernel's C launcher (a gcc run, cached by Triton like the kernel), which
    Triton would otherwise build at the kernel's first launch, on the main thread."""

    def submit(self, fn, /, *args, **kwargs):
        def compile_and_link():
            kernel = fn(*args, **kwargs)
            from triton.runtime.driver import driver

            driver.active.launcher_cls(kernel.src, kernel.metadata)
            return kernel

        return super().submit(compile_and_link)


_compiling_only = False


def compiling_only() -> bool:
    """Whether a compile_only block is active (code that must not run an autotuner on compile-only launches,
    fla's chunk_kda, asks; kestrel/attention/kda.py)."""
    return _compiling_only


@contextlib.contextmanager
def compile_only(workers: int | None = None):
    """Inside: launching a Triton kernel (`kernel[grid](...)`) compiles it in a thread pool and returns without
    running it. On exit: all compilations have finished (errors raise here). Yields a CompileCounter."""
    global _compiling_only
    workers = workers or min(16, os.cpu_count() or 1)
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    with CompileCounter() as counter, _CompileAndLinkPool(workers, thread_name_prefix="triton-compile") as pool:
        JITFunction.run = compile_instead  # every launch site, ours and future ones, without a launch wrapper
        _compiling_only = True
        try:
            with triton.AsyncCompileMode(pool):
                yield counter
        finally:
            JITFunction.run = run
            _compiling_only = False


def precompile(dry_run, what: str = "start-up") -> CompileCounter | None:
    """Run `dry_run()` in compile-only mode and log how many variants it compiled and how long it took. A failure
    is logged and ignored: the real runs then compile what they need one by one, as without this step."""
    t0 = time.perf_counter()
    try:
        with compile_only() as counter:
            dry_run()
    except Exception as e:  # noqa: BLE001 - an optimisation must not stop the engine
        logger.warning("Parallel Triton pre-compilation failed (%s: %s); kernels compile at first use",
                       type(e).__name__, e)
        return None
    logger.info("Pre-compiled %d Triton kernel variants for %s in %.1f s", counter.count, what,
                time.perf_counter() - t0)
    return counter

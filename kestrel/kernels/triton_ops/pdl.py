"""Programmatic dependent launch for the Triton kernels of a decode step.

A kernel compiled with PDL=True begins with griddepcontrol.wait (nothing it reads or writes is touched before its
predecessor has finished and flushed) and then lets its own successor launch. Launched with launch_pdl, the
kernel's blocks are scheduled while the predecessor still runs, so the launch gap between two small kernels
(~1 us inside a CUDA graph) overlaps work. Waiting before signalling keeps at most one kernel queued ahead.
Kernels and torch ops without PDL keep ordinary stream order, so mixing them is safe. Off with --no-pdl
(CompilationConfig.pdl), which the model runner passes to `configure_pdl` before any kernel compiles.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.platform.triton_gates import interpreter_mode


_requested = True


def configure_pdl(enabled: bool) -> None:
    """The engine's setting (CompilationConfig.pdl); call before the first kernel launch."""
    global _requested
    _requested = enabled
    pdl_enabled.cache_clear()


@functools.cache
def pdl_enabled() -> bool:
    if interpreter_mode() or not _requested:
        return False
    from kestrel.platform.capabilities import check_pdl

    return check_pdl()[0]


PDL_MAX_ROWS = 8  # measured on the H200 (benchmarks.md, session 4): batch 256 throughput 23.7k -> 19.8k with PDL


def pdl_launch(rows: int) -> dict:
    """Launch options (with the PDL constexpr) for a kernel that starts with `pdl_prologue(PDL)`, working on
    `rows` tokens or sequences. Only small batches use PDL: their kernels are one short wave and launch gaps
    dominate; in bigger ones the early-resident blocks of the next kernel, waiting, take SM slots from the
    running kernel's later waves (and a PDL and a plain variant of a kernel are two compilations)."""
    return {"PDL": True, "launch_pdl": True} if rows <= PDL_MAX_ROWS and pdl_enabled() else {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

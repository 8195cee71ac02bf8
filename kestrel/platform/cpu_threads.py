"""How many torch threads a process that runs a model on the CPU takes. Oversubscribed threads (several processes,
or other work, each spinning on every core) make decode steps up to tens of times slower, so each takes a share."""
from __future__ import annotations

import os

import torch

SMALL_MACHINE_CORES = 4  # up to this many usable cores, an offline run leaves one to the rest of the machine


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def runs_on_cpu(config) -> bool:
    return config.model.device == "cpu" or (config.model.device == "auto" and not torch.cuda.is_available())


def engine_core_threads(config) -> int:
    """An engine-core process beside the server: --cpu-threads, else its share of the cores (the data-parallel
    engine cores and the server process share them)."""
    return config.parallel.cpu_threads or max(1, usable_cores() // (config.parallel.data_parallel_size + 1))


def offline_threads(config) -> int:
    """The one process of LLM(...), `kestrel generate|chat|bench`: --cpu-threads, else torch's own choice, less one
    core on a small machine (where the tokenizer, the detokenizer and everything else would fight it)."""
    if config.parallel.cpu_threads:
        return config.parallel.cpu_threads
    cores = usable_cores()
    return max(1, cores - 1) if cores <= SMALL_MACHINE_CORES else torch.get_num_threads()


def apply_cpu_threads(config, threads) -> None:
    """torch.set_num_threads(threads(config)) when the model runs on the CPU."""
    if runs_on_cpu(config):
        torch.set_num_threads(threads(config))

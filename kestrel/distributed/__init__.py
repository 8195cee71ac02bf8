"""Tensor-parallel state handed to the layers through the model context: this process's rank, the group size and
the torch.distributed group, with the two collectives the parallel layers need. The default (rank 0 of 1) makes
every collective a no-op, so single-process code paths never touch torch.distributed."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch

from kestrel.errors import ConfigError


@dataclass
class ParallelInfo:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed group (None: the default group)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` rows; `what` names the dimension in errors."""
        if total % self.size:
            raise ConfigError(f"{what} = {total} is not divisible by --tensor-parallel-size {self.size}")
        n = total // self.size
        return self.rank * n, n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (in rank order)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def check_divisible(text_config, size: int) -> None:
    """Fail before any worker starts when the model cannot be split `size` ways (heads, MLP width)."""
    if size == 1:
        return
    heads = getattr(text_config, "num_attention_heads", None)
    # per layer where transformers' per_layer_config varies it (Gemma 4), which a global read refuses
    layers = ([text_config.per_layer_config[i] for i in range(text_config.num_hidden_layers)]
              if getattr(text_config, "is_heterogeneous", False) else [text_config])
    checks = [("num_attention_heads", heads)] + [(k, getattr(text_config, k, None)) for k in (
        "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")]
    for what, n in checks:
        if n is not None and n % size:
            raise ConfigError(f"{what} = {n} is not divisible by --tensor-parallel-size {size}")
    for kv in sorted({getattr(c, "num_key_value_heads", None) or heads for c in layers} - {None}):
        if kv % size and size % kv:
            raise ConfigError(f"--tensor-parallel-size {size} is neither a divisor nor a multiple of "
                              f"num_key_value_heads = {kv}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOOPBACK = ("127.0.0.1", "localhost")
RENDEZVOUS_TIMEOUT_S = 600
_listeners: list[socket.socket] = []


def loopback_store(rank: int, size: int, init_method: str):
    """The rendezvous store of a tcp://127.0.0.1:PORT init method, listening on loopback only (torch's own
    TCPStore listens on every interface, unauthenticated: anyone who reaches the machine could read and write
    it); None for any other init method (a Ray group spans machines)."""
    import datetime
    import urllib.parse

    import torch.distributed as dist

    url = urllib.parse.urlparse(init_method)
    if url.scheme != "tcp" or url.hostname not in LOOPBACK:
        return None
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", url.port, size, False, timeout=timeout)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", url.port))
    listener.listen()
    store = dist.TCPStore("127.0.0.1", url.port, size, True, timeout=timeout, master_listen_fd=listener.fileno(),
                          wait_for_workers=False)
    _listeners.append(listener)  # the store serves on this socket: keep it open for the process's life
    return store


def init_distributed(rank: int, size: int, init_method: str, device: torch.device) -> ParallelInfo:
    """Join the tensor-parallel group: NCCL on CUDA, gloo on the CPU."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    store = loopback_store(rank, size, init_method)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kw)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, **kw)
    # one collective now: a broken group fails at start-up, not at the first step (and NCCL runs even at size 1)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != size:
        raise RuntimeError(f"tensor-parallel group check: all-reduce gave {probe.item()}, expected {size}")
    return ParallelInfo(rank, size, None)

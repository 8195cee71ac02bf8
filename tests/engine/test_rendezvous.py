"""Issue 33: the tensor-parallel rendezvous (torch's TCPStore) listened on every interface, unauthenticated. A
loopback init method now gets a store that listens on 127.0.0.1 only, and the group still forms."""
from __future__ import annotations

import multiprocessing as mp

import psutil

from kestrel.distributed import free_port, loopback_store


def _join(rank: int, port: int, out) -> None:
    import torch

    from kestrel.distributed import init_distributed

    info = init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    out.put((rank, info.size))


def _listening(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]


def test_the_store_listens_on_loopback_only():
    port = free_port()
    store = loopback_store(0, 1, f"tcp://127.0.0.1:{port}")
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert _listening(port) == ["127.0.0.1"]
    assert loopback_store(0, 1, "tcp://10.1.2.3:29500") is None  # a multi-machine (Ray) group keeps torch's


def test_two_ranks_form_a_group_over_the_loopback_store():
    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_join, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(120)  # a loaded CI machine once took over 30 s to end a spawned rank (exitcode still None)
    assert got == [(0, 2), (1, 2)] and all(p.exitcode == 0 for p in procs)

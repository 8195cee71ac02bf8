"""The KV tier's row copy kernel (kestrel/kernels/triton_ops/kv_rows.py) against an indexed copy: on CUDA between
the device and pinned host memory both ways (the GPU reaching the host rows), or under the Triton interpreter on
the CPU (make kernels-check); skipped otherwise. And which copy kv_host_tier.copy_rows chooses."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
CUDA = torch.cuda.is_available()


def slots(rows: list[int], n: int, device, pin=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, 256, (n, r), dtype=torch.uint8, generator=g) for r in rows]
    return [t.pin_memory() if pin else t.to(device) for t in out]


@pytest.mark.skipif(not _ok, reason=_why)
@pytest.mark.parametrize("rows", [[64 * 1024, 64 * 1024], [4 * 1000 + 4, 20], [7, 5]])  # words, ragged, bytes
@pytest.mark.parametrize("direction", ["save", "load"])
def test_rows_copied_where_the_ids_say(rows, direction):
    from kestrel.kernels.triton_ops.kv_rows import copy_rows_triton
    dev = "cuda" if CUDA else "cpu"
    device_side, host_side = slots(rows, 12, dev, seed=1), slots(rows, 9, dev, pin=CUDA, seed=2)
    src, dst = (device_side, host_side) if direction == "save" else (host_side, device_side)
    src_ids, dst_ids = torch.tensor([11, 0, 5, 6, 2]), torch.tensor([3, 8, 0, 1, 4])
    if direction == "load":
        src_ids, dst_ids = dst_ids, src_ids
    want = [d.cpu().clone() for d in dst]
    for w, s in zip(want, src):
        w[dst_ids] = s.cpu()[src_ids]
    copy_rows_triton(dst, dst_ids.to(dev), src, src_ids.to(dev))
    if CUDA:
        torch.cuda.synchronize()
    assert all(torch.equal(d.cpu(), w) for d, w in zip(dst, want))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the kernel reads pinned host memory from the GPU")
def test_copy_rows_takes_the_kernel_where_the_host_side_is_pinned(monkeypatch):
    from kestrel.kernels.triton_ops import kv_rows
    from kestrel.worker import kv_host_tier
    calls = []
    real = kv_rows.copy_rows_triton
    monkeypatch.setattr(kv_rows, "copy_rows_triton", lambda *a: calls.append(1) or real(*a))
    runs = []
    monkeypatch.setattr(kv_host_tier, "copy_runs", lambda *a: runs.append(1))
    dev, host = slots([4096], 6, "cuda"), slots([4096], 6, "cpu", pin=True, seed=3)
    kv_host_tier.copy_rows(host, torch.tensor([1, 4]), dev, torch.tensor([5, 0]))
    torch.cuda.synchronize()
    assert calls == [1] and not runs
    assert torch.equal(host[0][1], dev[0][5].cpu()) and torch.equal(host[0][4], dev[0][0].cpu())
    kv_host_tier.copy_rows(slots([4096], 6, "cpu"), torch.tensor([1]), dev, torch.tensor([5]))  # not pinned
    assert calls == [1] and runs == [1]

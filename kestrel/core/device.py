"""The device a run uses, and small host-to-device helpers shared by the runner, the sampler and the add-ons."""
from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    """--device: "auto" is CUDA where there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list (or CPU tensor) on the device without a host sync: through pinned memory on CUDA (a plain
    torch.tensor(..., device=cuda) copies from pageable memory, which waits for the work in flight)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    return torch.as_tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)

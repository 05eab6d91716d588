"""Host lists to device tensors without a sync (the hot paths' one way of sending ids up)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(data: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; on CUDA through pinned memory and an asynchronous
    copy, so the caller does not wait for the device."""
    tensor = torch.tensor(list(data), dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor

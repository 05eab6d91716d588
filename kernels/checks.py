"""Argument checks shared by the kernel launchers.

A kernel given a wrong shape, dtype, stride or device reads or writes the wrong memory without a
word; these checks turn that into a ValueError naming the argument before anything is launched.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t: torch.Tensor, *, dim: int | None = None,
                 shape: Sequence[int | None] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None,
                 unit_last_stride: bool = True) -> None:
    """Raise ValueError unless `t` matches; None in `shape` accepts any size in that place."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = len(shape) == t.dim() and all(
            s is None or s == n for s, n in zip(shape, t.shape, strict=True))
        if not ok:
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not among {tuple(dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} like the other arguments")
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {t.stride(-1)})")


@functools.cache
def multiprocessors(device: torch.device) -> int | None:
    """The CUDA device's multiprocessor count; None elsewhere (the interpreter), where each
    launcher assumes its own stand-in."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

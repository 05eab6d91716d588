"""The KV pool layout that transports move blocks of, and block copies between two pools.

A pool is the engine's kv_cache: [num_layers, 2 (key, value), num_blocks, block_size, kv_heads,
head_dim]. Block b of a pool is pool[:, :, b].
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.registry import HandoffDescriptor

KV_LAYOUT = "layers,kv,blocks,block_size,kv_heads,head_dim"
# Every pool's per-tensor scale (an fp8 pool's values are the K/V themselves: kernels.kv_store).
KV_SCALE = 1.0
BLOCK_AXIS = 2


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def handoff_bytes(desc: HandoffDescriptor, pool: torch.Tensor) -> int:
    """The bytes one handoff moves: its blocks of every tensor-parallel rank's shard (each
    shard's KV-head range; one rank's heads at size 1). pool: either side's, of the
    descriptor's dtype."""
    heads = (sum(end - first for first, end in (s["kv_heads"] for s in desc.shards))
             if desc.shards else desc.num_kv_heads)
    return (len(desc.block_ids) * desc.num_layers * 2 * desc.block_size * heads
            * desc.head_dim * pool.element_size())


def check_pool(pool: torch.Tensor) -> None:
    if pool.dim() != 6 or pool.shape[1] != 2:
        raise ValueError(f"a KV pool is [{KV_LAYOUT}], got shape {tuple(pool.shape)}")


_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the transfer stream
_streams_lock = threading.Lock()


@contextlib.contextmanager
def transfer_stream(pool: torch.Tensor, after: torch.cuda.Event | None = None) -> Iterator[None]:
    """Run a transfer's device work (copies, checksums) on a stream of its own, so it does not
    queue behind the engine's steps on the default stream; it waits only for `after`. Nothing
    orders the engine's later work after it: the caller syncs (the checksum's read does) before
    the engine touches the blocks. A no-op for CPU pools."""
    if not pool.is_cuda:
        yield
        return
    index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(index)
    with torch.cuda.device(index), torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        yield


class WaitingStreams:
    """CUDA streams for copies queued behind a wait on ANOTHER process's event (an early
    handoff's copy waits on the device for the prefill's step: decode_service/handoff.py). A
    source that dies before its step ends may leave such a wait pending for good, so each copy
    gets a stream nothing else uses, reused only once its last copy has completed; a stream left
    waiting is never handed out again. They are made through the driver API: torch's streams
    come from a pool that hands each one out again after 32 others. Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[torch.cuda.ExternalStream, torch.cuda.Event]]] = {}
        self._driver: ctypes.CDLL | None = None

    def take(self, device: torch.device) -> torch.cuda.ExternalStream:
        """A stream of the device with nothing queued on it; give it back with give()."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            idle = self._free.setdefault(index, [])
            for i, (stream, done) in enumerate(idle):
                if done.query():
                    del idle[i]
                    return stream
            if self._driver is None:
                self._driver = ctypes.CDLL("libcuda.so.1")
        with torch.cuda.device(index):  # the device's primary context current on this thread
            torch.cuda.current_stream().query()
            handle = ctypes.c_void_p()
            code = self._driver.cuStreamCreate(ctypes.byref(handle), _CU_STREAM_NON_BLOCKING)
        if code != 0:
            raise RuntimeError(f"cuStreamCreate failed with CUresult {code}")
        return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))

    def give(self, stream: torch.cuda.ExternalStream, done: torch.cuda.Event) -> None:
        """stream's last work is recorded by done: reusable once done completes."""
        with self._lock:
            self._free.setdefault(stream.device.index, []).append((stream, done))


_CU_STREAM_NON_BLOCKING = 1
waiting_streams = WaitingStreams()


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs of blocks consecutive on both sides, in order.

    >>> block_runs([4, 5, 6, 9], [0, 1, 7, 8])
    [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int],
                dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
    """dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]] for every i, straight from the source pool
    (no staging): one kernel (kernels.block_copy) when both pools are on one GPU, else one copy
    per run of consecutive blocks, across devices if need be."""
    runs = block_runs(src_ids, dst_ids)
    if src.is_cuda and src.device == dst.device:
        # Imported here: CPU-only processes never load Triton through this module.
        from kernels.block_copy import copy_listed_blocks
        copy_listed_blocks(src, dst, src_ids, dst_ids, block_dim=BLOCK_AXIS)
        return
    for s, d, n in runs:
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n])

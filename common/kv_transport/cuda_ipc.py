"""cuda_ipc: source and receiver on one host, CUDA pools. The descriptor carries the source pool's
CUDA IPC handle (what torch.multiprocessing's reduce_tensor produces, in JSON with base64 bytes);
a receiver opens it once per source (cached), then copies the listed blocks device to device.

Rules:
- describe_pool() is called once per pool, at start-up, not per handoff: every call registers
  another IPC reference with torch's producer-side bookkeeping.
- The source publishes a handoff only after its KV writes completed on the device (the engine's
  step ends with a host sync when it reads the sampled token), so the receiver's copy sees them.
- The handle names a device of the source process; the receiver opens it on its own device with
  the same GPU UUID, so the two processes may number their visible GPUs differently.
- A source whose handle no receiver ever opened logs "Producer process has been terminated before
  all shared CUDA tensors released" at exit (torch's bookkeeping); harmless, the pool lives until
  then anyway.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from common.engine.uploads import to_device
from common.errors import TransferError
from common.kv_transport.base import KVTransport, check_source
from common.kv_transport.blocks import (
    BLOCK_AXIS,
    check_pool,
    copy_blocks,
    dtype_from_name,
    dtype_name,
)
from common.kv_transport.checksum import combine
from common.registry.records import HandoffDescriptor


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def describe_pool(pool: torch.Tensor) -> dict[str, Any]:
    """The descriptor's "cuda_ipc" entry for a CUDA pool."""
    check_pool(pool)
    if not pool.is_cuda:
        raise ValueError(f"cuda_ipc needs a CUDA pool, got one on {pool.device}")
    _, args = reduce_tensor(pool.detach())
    (_tensor_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return {
        "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "size": list(size), "stride": list(stride), "offset": int(offset),
        "dtype": dtype_name(dtype),
        "handle": _b64(handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }


def local_device_index(device_uuid: str) -> int:
    """The index under which this process sees the GPU with that UUID."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device_uuid:
            return i
    raise TransferError(f"GPU {device_uuid} is not visible to this process")


def open_pool(info: dict[str, Any]) -> torch.Tensor:
    """Rebuild the source pool tensor from its "cuda_ipc" entry (in a process other than the
    source's: CUDA refuses to open a process's own IPC handle)."""
    device = local_device_index(info["device_uuid"])
    with torch.cuda.device(device):
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(info["size"]), tuple(info["stride"]), info["offset"],
            torch.UntypedStorage, dtype_from_name(info["dtype"]), device, _unb64(info["handle"]),
            info["storage_size_bytes"], info["storage_offset_bytes"], False,
            _unb64(info["ref_counter_handle"]), info["ref_counter_offset"],
            _unb64(info["event_handle"]), info["event_sync_required"])


def _one_gpu(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Both pools contiguous, of one dtype, on one GPU: copy_block_sums takes them."""
    return (src.device == dst.device and src.is_contiguous() and dst.is_contiguous()
            and src.dtype == dst.dtype)


def _upload_ids(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor,
                dst_ids: list[int]) -> torch.Tensor:
    """[2, n] int64 ids on the device for copy_block_sums, queued on the current stream.
    TransferError for destination ids outside dst."""
    if any(not 0 <= b < dst.shape[BLOCK_AXIS] for b in dst_ids):
        raise TransferError(f"destination block ids outside [0, {dst.shape[BLOCK_AXIS]})")
    return to_device([list(src_ids), list(dst_ids)], torch.int64, src.device)


def _copy_with_sums(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor,
                    dst_ids: list[int]) -> torch.Tensor:
    """Queue copy_block_sums on the current stream: [n, 2] int64 sums on the device.
    TransferError for destination ids outside dst."""
    from kernels.block_sums import copy_block_sums  # CPU-only processes never load Triton
    ids = _upload_ids(src, src_ids, dst, dst_ids)
    with torch.cuda.device(src.device):  # Triton launches on the current device
        return copy_block_sums(src, dst, ids)


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self) -> None:
        self._pools: dict[str, torch.Tensor] = {}  # IPC handle (base64) -> opened source pool
        self._events: dict[bytes, torch.cuda.Event] = {}  # early handoffs' events, opened
        # Pulls run on one thread, early copies (prepare_copy) on their own: a handle is
        # opened once, under this lock.
        self._opening = threading.Lock()

    def _source(self, info: dict[str, Any]) -> torch.Tensor:
        pool = self._pools.get(info["handle"])
        if pool is None:
            with self._opening:
                pool = self._pools.get(info["handle"])
                if pool is None:
                    try:
                        pool = open_pool(info)
                    except RuntimeError as e:
                        raise TransferError(
                            f"cannot open the source pool's CUDA IPC handle: {e}") from e
                    self._pools[info["handle"]] = pool
        return pool

    def _pull(self, desc: HandoffDescriptor, info: dict[str, Any], dst_pool: torch.Tensor,
              dst_block_ids: list[int], timeout_s: float) -> int | None:
        """On one GPU: the copy and the checksum of the words it copies in one kernel
        (kernels.block_sums.copy_block_sums), one upload of the ids and one read of the sums;
        across GPUs, or pools that are not contiguous: the copy, then pull()'s checksum."""
        if not dst_pool.is_cuda:
            raise TransferError("cuda_ipc needs a CUDA destination pool")
        src = self._source(info)
        check_source(desc, src)
        if not _one_gpu(src, dst_pool):
            copy_blocks(src, desc.block_ids, dst_pool, dst_block_ids)
            return None
        return combine(_copy_with_sums(src, list(desc.block_ids), dst_pool,
                                       dst_block_ids).tolist())

    def prepare_copy(self, info: dict[str, Any], src_ids: list[int], dst_pool: torch.Tensor,
                     dst_ids: list[int], source_event: torch.cuda.Event | None = None,
                     ) -> Callable[[], tuple[torch.Tensor, torch.cuda.Event]]:
        """An early handoff's copy (decode_service/handoff.py), in two parts: now, the source
        pool opened, the ids uploaded and the sums zeroed on the current stream (the caller's
        transfer stream), the pinned host buffer, the event and the kernel's checks; the
        returned launch, called on the same stream once the source's KV is written, queues
        copy_block_sums of src_ids into dst_ids, the sums' copy to the host buffer behind it
        and the event behind that, and returns (the host sums, the event), read once the event
        completes (marks: gets the moment the kernel was launched). One GPU, contiguous pools
        of one dtype; TransferError otherwise or for ids outside either pool. source_event:
        the launch queues a wait for it first, on the device (then it may be called before the
        source's KV is written: the copy runs when the event completes). Any thread."""
        src = self._source(info)
        if (not _one_gpu(src, dst_pool) or src.shape[:2] != dst_pool.shape[:2]
                or src.shape[3:] != dst_pool.shape[3:]):
            raise TransferError("an early copy needs two contiguous pools of one shape and dtype "
                                "on one GPU")
        if len(src_ids) != len(dst_ids) or any(not 0 <= b < src.shape[BLOCK_AXIS]
                                               for b in src_ids):
            raise TransferError("early copy: block ids outside the pools")
        from kernels.block_sums import prepare_copy_block_sums  # CPU-only: never loaded
        ids = _upload_ids(src, src_ids, dst_pool, dst_ids)
        sums = torch.zeros((len(src_ids), 2), dtype=torch.int64, device=dst_pool.device)
        host = torch.empty((len(src_ids), 2), dtype=torch.int64, pin_memory=True)
        done = torch.cuda.Event()
        kernel = prepare_copy_block_sums(src, dst_pool, ids, sums)

        def launch(marks: dict[str, float] | None = None,
                   ) -> tuple[torch.Tensor, torch.cuda.Event]:
            if source_event is not None:
                torch.cuda.current_stream(src.device).wait_event(source_event)
            with torch.cuda.device(src.device):  # Triton launches on the current device
                kernel()
            if marks is not None:  # the moments of a launch, for a debug breakdown
                marks["early copy kernel launched"] = time.time()
            host.copy_(sums, non_blocking=True)
            done.record()
            return host, done

        return launch

    def open_event(self, info: dict[str, Any], handle: bytes) -> torch.cuda.Event:
        """The source process's interprocess event with that handle, opened once (any
        thread)."""
        event = self._events.get(handle)
        if event is None:
            try:
                event = torch.cuda.Event.from_ipc_handle(
                    local_device_index(info["device_uuid"]), handle)
            except RuntimeError as e:
                raise TransferError(f"cannot open the source's CUDA IPC event: {e}") from e
            self._events[handle] = event
        return event

    def forget(self, handle: str) -> None:
        """Drop the cached pool of a source that went away."""
        self._pools.pop(handle, None)

    def close(self) -> None:
        self._pools.clear()
        self._events.clear()

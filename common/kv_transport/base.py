"""KVTransport: moves a handoff's KV blocks from the source pool into blocks of a receiver's pool.

Receiver rules:
- The caller reserves dst_block_ids (engine.kv.reserve) before pull() and owns them: when
  pull() raises TransferError (unreachable source, timeout, geometry or checksum mismatch) the
  blocks hold garbage and the caller frees them (engine.free_blocks) and decides what to do with
  the request; the transport never frees or reserves anything.
- pull() checks the pulled blocks against desc.checksum (common.kv_transport.checksum) on the
  receiver's own pool, so whatever the route, a block the source reused or a mix-up is caught.
- The source holds its blocks only until the delivery's deadline (its lease): the caller discards
  a pull that ended too close to it (decode_service/handoff.py).

Implementations keep per-source state (mapped files, opened IPC handles, channels) across pulls;
close() drops it. pull() may be called from a worker thread; one transport object is not meant to
be used by two threads at once.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from common.errors import TransferError
from common.kv_transport.blocks import KV_LAYOUT, KV_SCALE, dtype_name, transfer_stream
from common.kv_transport.checksum import kv_checksum
from common.registry.records import HandoffDescriptor

log = logging.getLogger("splitserve.kv_transport")


def check_geometry(desc: HandoffDescriptor, dst_pool: torch.Tensor,
                   dst_block_ids: Sequence[int]) -> None:
    """The source blocks fit the destination pool: same layout, dtype and per-block shape."""
    if desc.layout != KV_LAYOUT:
        raise TransferError(f"source layout {desc.layout!r}, expected {KV_LAYOUT!r}")
    want = (desc.num_layers, 2, desc.block_size, desc.num_kv_heads, desc.head_dim)
    shape = tuple(dst_pool.shape)
    if dst_pool.dim() != 6 or (shape[0], shape[1], *shape[3:]) != want:
        raise TransferError(f"source blocks {want} do not fit destination pool {shape}")
    if desc.dtype != dtype_name(dst_pool.dtype) or desc.kv_scale != KV_SCALE:
        raise TransferError(
            f"KV cache dtype mismatch: the source pool holds {desc.dtype} (scale "
            f"{desc.kv_scale}), this one {dtype_name(dst_pool.dtype)} (scale {KV_SCALE}); "
            "both sides must run with the same --kv-cache-dtype (and --dtype)")
    if len(dst_block_ids) != len(desc.block_ids):
        raise TransferError(f"{len(desc.block_ids)} source blocks, "
                            f"{len(dst_block_ids)} destination blocks")
    if any(not 0 <= b < shape[2] for b in dst_block_ids):
        raise TransferError(f"destination block ids outside [0, {shape[2]})")


def check_source(desc: HandoffDescriptor, src_pool: torch.Tensor) -> None:
    """A mapped source pool matches its descriptor and holds the listed blocks."""
    want = (desc.num_layers, 2, desc.block_size, desc.num_kv_heads, desc.head_dim)
    shape = tuple(src_pool.shape)
    if src_pool.dim() != 6 or (shape[0], shape[1], *shape[3:]) != want:
        raise TransferError(f"source pool {shape} does not match its descriptor {want}")
    if any(not 0 <= b < shape[2] for b in desc.block_ids):
        raise TransferError(f"source block ids outside [0, {shape[2]})")


class KVTransport(ABC):
    """One way of reaching a source pool; chosen by name (see select.TRANSPORTS)."""

    name: ClassVar[str]

    def pull(self, desc: HandoffDescriptor, dst_pool: torch.Tensor,
             dst_block_ids: Sequence[int], timeout_s: float = 30.0,
             after: torch.cuda.Event | None = None) -> None:
        """Copy the source blocks desc.block_ids into dst_pool's dst_block_ids (same order) and
        verify the checksum; raises TransferError (see the module docstring). On a GPU the
        copy runs on the transfer stream (blocks.transfer_stream) after `after` (the event
        engine.kv.reserve_for_copy returned with the blocks, if any); it has completed when
        pull() returns."""
        check_geometry(desc, dst_pool, dst_block_ids)
        info = desc.transports.get(self.name)
        if info is None:
            raise TransferError(f"handoff {desc.request_id} offers no {self.name} transport")
        start = time.perf_counter()
        with transfer_stream(dst_pool, after):
            got = self._pull(desc, info, dst_pool, list(dst_block_ids), timeout_s)
            copied = time.perf_counter()
            if got is None:  # reads the sum back: syncs the stream
                got = kv_checksum(dst_pool, dst_block_ids)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("handoff %s via %s: copy %.2f ms, checksum %.2f ms more",
                      desc.request_id, self.name, 1e3 * (copied - start),
                      1e3 * (time.perf_counter() - copied))
        if got != desc.checksum:
            raise TransferError(f"handoff {desc.request_id}: checksum mismatch over "
                                f"{len(dst_block_ids)} blocks via {self.name} "
                                f"(source {desc.checksum}, received {got})")

    @abstractmethod
    def _pull(self, desc: HandoffDescriptor, info: dict[str, Any], dst_pool: torch.Tensor,
              dst_block_ids: list[int], timeout_s: float) -> int | None:
        """Copy the blocks; raise TransferError on failure. Returns the checksum of what it
        copied if it computed it while copying (then complete), else None: pull() computes it
        on the destination."""

    @abstractmethod
    def close(self) -> None:
        """Drop per-source state (mappings, handles, channels)."""

"""local: source and receiver engines in one process (tests, `splitserve run-batch`).

A process-wide table maps a source instance id to its pool tensor; the receiver copies the blocks
straight from it. No serialization, no staging.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from common.errors import TransferError
from common.kv_transport.base import KVTransport, check_source
from common.kv_transport.blocks import check_pool, copy_blocks
from common.kv_transport.locality import process_id
from common.registry.records import HandoffDescriptor

_pools: dict[str, torch.Tensor] = {}
_lock = threading.Lock()


def share_pool(instance_id: str, pool: torch.Tensor) -> dict[str, Any]:
    """Make pool reachable in this process; returns the descriptor's "local" entry."""
    check_pool(pool)
    with _lock:
        _pools[instance_id] = pool
    return {"process_id": process_id(), "instance_id": instance_id}


def unshare_pool(instance_id: str) -> None:
    with _lock:
        _pools.pop(instance_id, None)


class LocalTransport(KVTransport):
    name = "local"

    def _pull(self, desc: HandoffDescriptor, info: dict[str, Any], dst_pool: torch.Tensor,
              dst_block_ids: list[int], timeout_s: float) -> None:
        if info["process_id"] != process_id():
            raise TransferError(f"handoff {desc.request_id} comes from another process")
        with _lock:
            src = _pools.get(info["instance_id"])
        if src is None:
            raise TransferError(f"no pool shared by instance {info['instance_id']!r}")
        check_source(desc, src)
        copy_blocks(src, desc.block_ids, dst_pool, dst_block_ids)

    def close(self) -> None:
        """Nothing to drop: the table belongs to the sources."""

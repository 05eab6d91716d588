"""KVSource: the prefill side of the transports. It offers one engine pool over every transport
that can reach it, serves export_kv for the gRPC servicer, and fills in handoff descriptors.

Offers: "local" always (the pool enters this process's table), "shm" when the pool was made by a
SharedMemoryPool, "cuda_ipc" when it is on a GPU, "grpc" when an address serving KVTransferService is
given. The descriptor lists them all; each receiver picks by locality (select.select_transport).
Under tensor parallelism the pool is rank 0's and `shards` (common/engine/rank_kv.RankShards)
reaches the others: the descriptor then lists every rank's shard (HandoffDescriptor.shards).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from common.kv_transport import cuda_ipc, local
from common.kv_transport.blocks import (
    BLOCK_AXIS,
    KV_LAYOUT,
    check_pool,
    dtype_name,
    transfer_stream,
)
from common.kv_transport.checksum import kv_checksum, prepare
from common.kv_transport.locality import host_id
from common.kv_transport.shm import SharedMemoryPool
from common.registry.records import HandoffDescriptor


class RankShards(Protocol):
    """The other tensor-parallel ranks' pools (common/engine/rank_kv.py)."""
    size: int

    def offers(self) -> list[dict[str, dict[str, Any]]]: ...

    def export(self, rank: int, block_ids: Sequence[int]) -> torch.Tensor: ...

    def describe(self, desc: HandoffDescriptor,
                 offers: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]: ...


class KVSource:
    def __init__(self, instance_id: str, pool: torch.Tensor, model: str, *,
                 address: str = "", shm: SharedMemoryPool | None = None,
                 host: str | None = None, shards: RankShards | None = None):
        """pool: the engine's kv_cache (rank 0's under tensor parallelism, `shards` the
        others'). address: host:port of the gRPC server where this process
        serves KVTransferService ("" = no grpc offer). shm: the allocator that made pool, if any.
        host: override for locality.host_id()."""
        check_pool(pool)
        prepare(pool)  # the CPU checksum kernel built now, not on the first handoff
        if shm is not None and shm.tensor is not pool:
            raise ValueError("shm did not allocate this pool")
        self.instance_id = instance_id
        self.pool = pool
        self.model = model
        self.address = address
        self.host = host if host is not None else host_id()
        self.offers: dict[str, dict[str, Any]] = {"local": local.share_pool(instance_id, pool)}
        if shm is not None:
            self.offers["shm"] = shm.describe()
        if pool.is_cuda:
            self.offers["cuda_ipc"] = cuda_ipc.describe_pool(pool)
        if address:
            self.offers["grpc"] = {"address": address}
        self.shards = shards
        self.rank_offers = shards.offers() if shards is not None else []
        if address:  # rank r's shard over grpc: this server asks rank r for it (export_kv)
            self.rank_offers = [{**offers, "grpc": {"address": address, "rank": r}}
                                for r, offers in enumerate(self.rank_offers, start=1)]

    def export_kv(self, block_ids: Sequence[int], rank: int = 0) -> torch.Tensor:
        """A copy of the blocks: [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim],
        of tensor parallel rank `rank`'s pool. Reads only the pool, so it is safe beside the
        engine's thread for blocks that are held."""
        size = self.shards.size if self.shards is not None else 1
        if not 0 <= rank < size:
            raise ValueError(f"no tensor parallel rank {rank}: the source has {size}")
        if rank:
            return self.shards.export(rank, block_ids)
        num_blocks = self.pool.shape[BLOCK_AXIS]
        if any(not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"block ids outside [0, {num_blocks})")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.pool.device)
        return self.pool.index_select(BLOCK_AXIS, index)

    def describe(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                 block_hashes: Sequence[int], checksum: int | None = None) -> HandoffDescriptor:
        """The handoff descriptor for held blocks whose KV is computed. checksum: theirs, if
        the engine computed it (KVConnector.checksum_of); else computed now, on the transfer
        stream (the engine synced on the step that wrote them before it reported them held,
        and the steps it launched since do not delay the checksum)."""
        layers, _, _, block_size, kv_heads, head_dim = self.pool.shape
        desc = HandoffDescriptor(
            request_id=request_id, source_instance=self.instance_id, source_address=self.address,
            source_host_id=self.host, model=self.model, dtype=dtype_name(self.pool.dtype),
            block_size=block_size, layout=KV_LAYOUT, num_layers=layers, num_kv_heads=kv_heads,
            head_dim=head_dim, num_tokens=num_tokens, block_ids=list(block_ids),
            block_hashes=[int(h) for h in block_hashes],
            checksum=self.checksum(block_ids) if checksum is None else checksum,
            transports={name: dict(info) for name, info in self.offers.items()},
            created_at=time.time())
        if self.shards is None:
            return desc
        return replace(desc, tensor_parallel_size=self.shards.size,
                       shards=self.shards.describe(desc, self.rank_offers))

    def checksum(self, block_ids: Sequence[int]) -> int:
        with transfer_stream(self.pool):
            return kv_checksum(self.pool, block_ids)

    def close(self) -> None:
        local.unshare_pool(self.instance_id)

"""Records as JSON (pure Python): service instances, which the registry stores, and KV handoff
descriptors, which a prefill service sends to a decode service with DecodeService.Deliver.

Both records tolerate fields they do not know (dropped on decode), so services of two versions can
share one registry during a rolling upgrade.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

InstanceKind = Literal["prefill", "decode"]
INSTANCE_KINDS: tuple[str, ...] = get_args(InstanceKind)


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _to_json(record: Any) -> str:
    """A record's fields as JSON. Shallow: the values are already JSON types, and asdict's deep
    copy of the id lists and transport offers cost 0.2 ms a handoff on the delivering path."""
    return json.dumps({f.name: getattr(record, f.name) for f in fields(record)},
                      separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """One prefill or decode service as the gateway sees it. The load fields are refreshed by the
    instance's Heartbeat; they are at most one heartbeat interval (ttl / 3) old."""

    instance_id: str
    kind: InstanceKind
    address: str                 # host:port of its gRPC server
    model: str
    host_id: str = ""            # common.kv_transport.locality.host_id() of its machine
    block_size: int = 0          # tokens per KV block (the prefix index hashes blocks of this size)
    num_waiting: int = 0
    num_running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    # Ranks of one engine (--tensor-parallel-size): a handoff goes rank to rank, so the gateway
    # pairs a prefill and a decode instance only when they have the same size.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")
        if self.kind not in INSTANCE_KINDS:
            raise ValueError(f"kind must be one of {INSTANCE_KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        return _to_json(self)

    @classmethod
    def from_json(cls, text: str) -> InstanceInfo:
        return cls(**_known_fields(cls, json.loads(text)))


@dataclass(frozen=True, slots=True)
class HandoffDescriptor:
    """Everything a decode service needs to pull one request's prompt KV from the prefill service.

    block_ids are the source's blocks in prompt order; the KV of block_ids[i] holds tokens
    [i * block_size, (i + 1) * block_size) of the prompt. `transports` maps each transport the
    source offers ("local", "shm", "cuda_ipc", "grpc") to what a receiver needs to use it (file
    path, IPC handle in base64, address, ...); common.kv_transport.select_transport picks one by
    locality. `checksum` is common.kv_transport.checksum.kv_checksum over the listed blocks.
    """

    request_id: str
    source_instance: str
    source_address: str          # host:port of the source's gRPC server (serves KVTransferService)
    source_host_id: str          # locality.host_id() of the source machine
    model: str
    dtype: str                   # torch dtype name without "torch.", e.g. "bfloat16"
    block_size: int
    layout: str                  # axes of the pool: "layers,kv,blocks,block_size,kv_heads,head_dim"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int              # prompt tokens whose KV the blocks hold
    block_ids: list[int]
    block_hashes: list[int]      # chained hashes of the full blocks (common.engine.core.block_manager)
    checksum: int
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)
    created_at: float = 0.0      # time.time() at publish
    # The pool's per-tensor scale: K/V = stored value * kv_scale (1.0 for every dtype today,
    # the fp8 pool included: kernels.kv_store); a receiver with another scale refuses the KV.
    kv_scale: float = 1.0
    # Tensor parallelism: the source's size, and for each of its ranks r (shards[r], rank 0
    # included, empty at size 1) {"kv_heads": [first, end), "checksum": int, "transports":
    # {...}}; num_kv_heads is one rank's. Rank r of a receiver of the same size pulls shard r
    # into its own pool (for_rank); checksum and transports above are rank 0's.
    tensor_parallel_size: int = 1
    shards: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if self.block_size < 1 or not self.block_ids:
            raise ValueError("a handoff needs block_size >= 1 and at least one block")
        if self.num_tokens > len(self.block_ids) * self.block_size:
            raise ValueError(f"{self.num_tokens} tokens do not fit in {len(self.block_ids)} "
                             f"blocks of {self.block_size}")
        if len(self.shards) != (self.tensor_parallel_size if self.tensor_parallel_size > 1
                                else 0):
            raise ValueError(f"{len(self.shards)} shards for tensor parallel size "
                             f"{self.tensor_parallel_size}")

    def for_rank(self, rank: int) -> HandoffDescriptor:
        """Rank `rank`'s part: its shard's checksum and transports in place of rank 0's."""
        if self.tensor_parallel_size == 1:
            return self
        shard = self.shards[rank]
        return replace(self, checksum=shard["checksum"], transports=shard["transports"],
                       tensor_parallel_size=1, shards=[])

    def completed(self, checksum: int, block_hashes: Sequence[int]) -> HandoffDescriptor:
        """This descriptor with the checksum and block hashes it was sent without (an early
        handoff's: prefill_service/delivery.py ring_early, ring_checksum)."""
        return replace(self, checksum=int(checksum), block_hashes=[int(h) for h in block_hashes])

    def to_json(self) -> str:
        return _to_json(self)

    @classmethod
    def from_json(cls, text: str) -> HandoffDescriptor:
        return cls(**_known_fields(cls, json.loads(text)))

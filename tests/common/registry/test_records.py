"""The registry's records (instances, handoff descriptors) and its namespace hygiene."""

from __future__ import annotations

import dataclasses

import pytest

from common.registry import HandoffDescriptor, InstanceInfo, Registry


def _desc(request_id: str, source: str = "p1") -> HandoffDescriptor:
    return HandoffDescriptor(
        request_id=request_id, source_instance=source, source_address="10.0.0.1:50051",
        source_host_id="host-a", model="SmolLM2-135M-Instruct", dtype="bfloat16", block_size=16,
        layout="layers,kv,blocks,block_size,kv_heads,head_dim", num_layers=30, num_kv_heads=3,
        head_dim=64, num_tokens=40, block_ids=[7, 3, 9], block_hashes=[123456789, 987654321],
        checksum=-42, transports={"grpc": {"address": "10.0.0.1:50051"},
                                  "cuda_ipc": {"handle": "aGFuZGxl", "event_handle": None}},
        created_at=1700000000.5)


def test_descriptor_round_trips_and_validates() -> None:
    desc = _desc("r1")
    assert HandoffDescriptor.from_json(desc.to_json()) == desc
    with pytest.raises(ValueError):
        dataclasses.replace(desc, num_tokens=49)  # 49 tokens need 4 blocks of 16
    with pytest.raises(ValueError):
        dataclasses.replace(desc, block_ids=[])


def test_a_tensor_parallel_descriptor_names_each_rank_shard() -> None:
    """Size 3 (one of SmolLM2's 3 KV heads per rank): shards[r] is rank r's; for_rank(r) is the
    plain descriptor rank r of a receiver pulls with, and a shard count that is not the size is
    refused."""
    base = _desc("r2")
    shards = [{"kv_heads": [r, r + 1], "checksum": 100 + r,
               "transports": {"shm": {"path": f"/dev/shm/rank{r}.kv"}}} for r in range(3)]
    desc = dataclasses.replace(base, num_kv_heads=1, tensor_parallel_size=3, shards=shards)
    assert HandoffDescriptor.from_json(desc.to_json()) == desc
    rank2 = desc.for_rank(2)
    assert (rank2.checksum, rank2.transports, rank2.tensor_parallel_size, rank2.shards) == (
        102, {"shm": {"path": "/dev/shm/rank2.kv"}}, 1, [])
    assert (rank2.block_ids, rank2.num_kv_heads) == (base.block_ids, 1)
    assert base.for_rank(0) is base
    with pytest.raises(ValueError, match="2 shards for tensor parallel size 3"):
        dataclasses.replace(desc, shards=shards[:2])
    assert InstanceInfo.from_json(InstanceInfo("d1", "decode", "a:1", "m").to_json()
                                  ).tensor_parallel_size == 1


def test_clear_instance_leaves_the_namespace_empty(registry: Registry) -> None:
    ns = registry.namespace
    for iid in ("p1", "p2"):
        registry.register(InstanceInfo(iid, "prefill", "a:1", "m"), ttl_s=10)
        registry.publish_prefix(iid, [1, 2, 3], [])
    registry.clear_instance("p1")
    assert registry.namespace_keys() == [f"{ns}:instance:p2", f"{ns}:prefix:p2"]
    registry.clear_instance("p2")
    assert registry.namespace_keys() == []

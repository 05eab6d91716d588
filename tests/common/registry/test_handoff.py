from __future__ import annotations

import dataclasses
import threading

import pytest

from common.registry import HandoffDescriptor, HandoffState, InstanceInfo, Registry


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


def test_publish_claim_complete(registry: Registry) -> None:
    registry.publish_handoff(_desc("r1"), lease_ttl_s=10)
    registry.publish_handoff(_desc("r1"), lease_ttl_s=10)  # a retried publish is a no-op
    with pytest.raises(ValueError):
        registry.publish_handoff(dataclasses.replace(_desc("r1"), checksum=1), lease_ttl_s=10)
    assert registry.handoff_exists("r1")
    assert registry.handoff_states(["r1"]) == {"r1": HandoffState.PENDING}
    assert registry.list_handoffs("p1") == [_desc("r1")]
    assert registry.list_handoffs("p2") == []

    assert registry.claim_handoff("r1", "d1") == _desc("r1")
    assert registry.claim_handoff("r1", "d1") == _desc("r1")  # the winner may retry
    assert registry.claim_handoff("r1", "d2") is None
    assert registry.handoff_states(["r1"]) == {"r1": HandoffState.CLAIMED}

    assert registry.complete_handoff("r1", claimer="d2") is False  # not its claim
    assert registry.handoff_exists("r1")
    assert registry.complete_handoff("r1", claimer="d1") is True
    assert registry.complete_handoff("r1", claimer="d1") is True  # a retried confirm
    assert not registry.handoff_exists("r1")
    assert registry.claim_handoff("r1", "d1") is None
    assert registry.handoff_states(["r1"]) == {"r1": HandoffState.DONE}
    assert registry.namespace_keys() == [f"{registry.namespace}:done:r1"]

    # The prefill side sees DONE once, releases the blocks, and the marker is gone.
    assert registry.reap_handoffs(["r1"]) == {"r1": HandoffState.DONE}
    assert registry.namespace_keys() == []
    assert registry.reap_handoffs(["r1"]) == {"r1": HandoffState.EXPIRED}


def _race(clients: list[Registry], request_id: str) -> list[HandoffDescriptor | None]:
    """Every client claims request_id at the same moment, from its own thread and connection."""
    barrier = threading.Barrier(len(clients))
    results: list[HandoffDescriptor | None] = [None] * len(clients)

    def claim(i: int) -> None:
        barrier.wait()
        results[i] = clients[i].claim_handoff(request_id, f"d{i}")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_exactly_one_of_eight_concurrent_claimers_wins(registry: Registry) -> None:
    clients = [Registry(registry.url, registry.namespace, timeout_s=2.0) for _ in range(8)]
    try:
        for round_ in range(10):
            rid = f"r{round_}"
            registry.publish_handoff(_desc(rid), lease_ttl_s=10)
            results = _race(clients, rid)
            winners = [i for i, r in enumerate(results) if r is not None]
            assert len(winners) == 1, winners
            assert results[winners[0]] == _desc(rid)
            assert registry.complete_handoff(rid, claimer=f"d{winners[0]}") is True
    finally:
        for c in clients:
            c.close()


def test_lease_expiry_reads_as_expired_not_done(registry: Registry, wait_until) -> None:
    registry.publish_handoff(_desc("r1"), lease_ttl_s=1.5)
    registry.publish_handoff(_desc("r2"), lease_ttl_s=1.5)
    assert registry.claim_handoff("r1", "d1") is not None
    assert registry.renew_lease("r2", ttl_s=10) is True
    wait_until(lambda: not registry.handoff_exists("r1"), 4.0)
    # The decode side was too slow: its confirm fails, it must discard the pulled KV.
    assert registry.complete_handoff("r1", claimer="d1") is False
    assert registry.renew_lease("r1", ttl_s=10) is False
    assert registry.reap_handoffs(["r1", "r2"]) == {"r1": HandoffState.EXPIRED,
                                                    "r2": HandoffState.PENDING}
    assert registry.namespace_keys() == [f"{registry.namespace}:handoff:r2"]


def test_cancel_withdraws_a_handoff(registry: Registry) -> None:
    registry.publish_handoff(_desc("r1"), lease_ttl_s=10)
    assert registry.cancel_handoff("r1") is True
    assert registry.cancel_handoff("r1") is False
    assert registry.claim_handoff("r1", "d1") is None
    assert registry.reap_handoffs(["r1"]) == {"r1": HandoffState.EXPIRED}


def test_cancel_after_a_racing_confirmation_leaves_no_marker(registry: Registry) -> None:
    """The source read the record as pending and withdraws it, but the decode side confirmed in
    between: the done marker must not outlive the withdrawal (no poll would reap it)."""
    registry.publish_handoff(_desc("r1"), lease_ttl_s=10)
    assert registry.claim_handoff("r1", "d1") is not None
    assert registry.complete_handoff("r1", claimer="d1") is True
    assert registry.cancel_handoff("r1") is False  # the record was gone already
    assert registry.namespace_keys() == []


def test_clear_instance_leaves_the_namespace_empty(registry: Registry) -> None:
    ns = registry.namespace
    for iid in ("p1", "p2"):
        registry.register(InstanceInfo(iid, "prefill", "a:1", "m"), ttl_s=10)
        registry.publish_prefix(iid, [1, 2, 3], [])
    registry.publish_handoff(_desc("r1", "p1"), lease_ttl_s=10)
    registry.publish_handoff(_desc("r2", "p1"), lease_ttl_s=10)
    registry.publish_handoff(_desc("r3", "p2"), lease_ttl_s=10)
    registry.claim_handoff("r2", "d1")
    registry.complete_handoff("r1")  # done marker of p1
    registry.clear_instance("p1")
    assert registry.namespace_keys() == [f"{ns}:handoff:r3", f"{ns}:instance:p2",
                                         f"{ns}:prefix:p2"]
    registry.clear_instance("p2")
    assert registry.namespace_keys() == []

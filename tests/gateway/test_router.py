"""Routing policy: prefix-cache-aware prefill choice weighed with load; decode by blocks and load."""

from __future__ import annotations

import pytest

from common.errors import NoInstanceError
from common.registry import InstanceInfo
from gateway.config import RouterConfig
from gateway.router import Router


def info(iid: str, kind: str = "prefill", *, running: int = 0, waiting: int = 0,
         free: int = 100, tp: int = 1) -> InstanceInfo:
    return InstanceInfo(instance_id=iid, kind=kind, address=f"{iid}:1", model="m",
                        block_size=16, num_running=running, num_waiting=waiting,
                        free_blocks=free, total_blocks=100, tensor_parallel_size=tp)


def test_prefill_pairs_only_with_a_decode_instance_of_its_tensor_parallel_size(caplog):
    router = Router(RouterConfig())
    p1, p2a, p2b, d1, d2, d4 = (info("p1"), info("p2a", tp=2), info("p2b", tp=2),
                                info("d1", "decode"), info("d2", "decode", tp=2),
                                info("d4", "decode", tp=4))
    assert router.pairable([p1, p2a, p2b], d2) == [p2a, p2b]
    assert router.pairable([p1, p2a, p2b], d1) == [p1]
    assert router.pairable([], d1) == []  # pick_prefill says none is registered
    with pytest.raises(NoInstanceError):
        router.pick_prefill(router.pairable([], d1), {})
    # None of its size: the decode instance prefills itself, said once per instance.
    assert router.pairable([p1, p2a], d4) == []
    assert router.pairable([p1, p2a], d4) == []
    said = [r.getMessage() for r in caplog.records]
    assert said == ["no prefill instance runs at tensor parallel size 4 like decode instance "
                    "d4 (sizes: [1, 2]): it prefills the prompt itself"]


def test_prefill_prefers_the_instance_holding_the_prefix():
    router = Router(RouterConfig(prefix_token_weight=1.0, queued_request_cost_tokens=256))
    a, b = info("a"), info("b")
    assert router.pick_prefill([a, b], {"a": 0, "b": 20}) is b
    assert router.pick_prefill([a, b], {}) is a  # a tie goes to the lower id


def test_prefill_prefix_is_weighed_against_load():
    router = Router(RouterConfig(prefix_token_weight=1.0, queued_request_cost_tokens=256))
    a, b = info("a"), info("b", waiting=2)
    # b holds 20 blocks (320 tokens) but has 2 queued: 320 - 512 < 0.
    assert router.pick_prefill([a, b], {"b": 20}) is a
    assert router.pick_prefill([a, b], {"b": 40}) is b  # 640 - 512 > 0


def test_gateway_inflight_counts_beat_stale_reports():
    router = Router(RouterConfig())
    a, b = info("a"), info("b")
    picks = []
    for _ in range(4):
        chosen = router.pick_prefill([a, b], {})
        router.acquire(chosen.instance_id)
        picks.append(chosen.instance_id)
    assert picks == ["a", "b", "a", "b"]
    for iid in picks:
        router.release(iid)
    assert not router.inflight


def test_decode_needs_room_then_least_load():
    router = Router(RouterConfig())
    small = info("a", "decode", free=3)
    busy = info("b", "decode", running=5, free=80)
    idle = info("c", "decode", running=1, free=60)
    # 100 tokens need 7 blocks of 16: "a" cannot take it.
    assert router.pick_decode([small, busy, idle], 100) is idle
    assert router.pick_decode([small], 100) is small  # nobody fits: still served
    assert router.pick_decode([info("x", "decode", free=10), info("y", "decode", free=50)],
                              16).instance_id == "y"  # equal load: more free blocks


def test_no_instance():
    with pytest.raises(NoInstanceError, match="no prefill instance"):
        Router(RouterConfig()).pick_prefill([], {})
    with pytest.raises(NoInstanceError, match="no decode instance"):
        Router(RouterConfig()).pick_decode([], 10)

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis

from common.registry import EmbeddedRedis, Heartbeat, InstanceInfo, Registry

ROOT = Path(__file__).resolve().parents[3]


def _info(instance_id: str, kind: str = "prefill", **load: int) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, kind=kind, address=f"10.0.0.1:{len(instance_id)}",
                        model="SmolLM2-135M-Instruct", host_id="h", block_size=16, **load)


def test_register_list_and_kinds(registry: Registry) -> None:
    assert registry.register(_info("p2"), ttl_s=10) is True
    assert registry.register(_info("p1"), ttl_s=10) is True
    assert registry.register(_info("p1", num_running=3), ttl_s=10) is False  # a refresh
    assert registry.register(_info("d1", kind="decode", free_blocks=7), ttl_s=10) is True
    assert registry.list_instances("prefill") == [_info("p1", num_running=3), _info("p2")]
    assert registry.list_instances("decode") == [_info("d1", kind="decode", free_blocks=7)]
    assert registry.get_instance("d1") == _info("d1", kind="decode", free_blocks=7)
    registry.deregister("p1")
    assert registry.list_instances("prefill") == [_info("p2")]
    assert registry.get_instance("p1") is None
    with pytest.raises(ValueError):
        registry.list_instances("gateway")


def test_instance_info_validates_and_tolerates_new_fields() -> None:
    with pytest.raises(ValueError):
        InstanceInfo("x", "gateway", "a:1", "m")
    with pytest.raises(ValueError):
        InstanceInfo("", "decode", "a:1", "m")
    text = _info("p1").to_json().replace("}", ',"from_the_future":1}')
    assert InstanceInfo.from_json(text) == _info("p1")


def test_dead_instance_disappears_within_its_ttl(registry: Registry, wait_until) -> None:
    registry.register(_info("p1"), ttl_s=1.0)
    registry.publish_prefix("p1", [11, 12], [])
    assert registry.list_instances("prefill") == [_info("p1")]
    # Both keys expire server-side within the TTL (measured by Redis, not by a loaded test box).
    for key in registry.namespace_keys():
        assert 0 < registry.redis.pttl(key) <= 1000, key
    wait_until(lambda: registry.list_instances("prefill") == [], 5.0)
    assert registry.namespace_keys() == []  # its prefix set went with it


def test_heartbeat_keeps_instance_alive_and_publishes_load(registry: Registry,
                                                           wait_until) -> None:
    hb = Heartbeat(registry, _info("p1"), ttl_s=1.5).start()
    try:
        time.sleep(3.2)  # two TTLs
        assert registry.list_instances("prefill") == [_info("p1")]
        hb.update(num_waiting=2, num_running=5, free_blocks=100, total_blocks=128)
        want = _info("p1", num_waiting=2, num_running=5, free_blocks=100, total_blocks=128)
        wait_until(lambda: registry.list_instances("prefill") == [want], 2.0)
        assert hb.reregistrations == 0 and hb.errors == 0
    finally:
        hb.stop()
    assert registry.list_instances("prefill") == []  # deregistered at once


def test_heartbeat_stop_without_deregister_lets_it_expire(registry: Registry,
                                                          wait_until) -> None:
    hb = Heartbeat(registry, _info("p1"), ttl_s=1.5).start()
    hb.stop(deregister=False)
    assert registry.list_instances("prefill") == [_info("p1")]
    wait_until(lambda: registry.list_instances("prefill") == [], 3.0)


def test_heartbeat_reregisters_after_redis_restart(wait_until) -> None:
    server = EmbeddedRedis()
    port = server.port
    registry = Registry(server.url, namespace="restart", timeout_s=0.5, retries=1)
    flags: list[str] = []
    hb = Heartbeat(registry, _info("p1"), ttl_s=0.9,
                   on_reregister=lambda: flags.append("republish prefixes")).start()
    try:
        registry.publish_prefix("p1", [11, 12], [])
        assert registry.match_prefix(["p1"], [11, 12]) == {"p1": 2}
        server.stop()
        wait_until(lambda: hb.errors >= 1, 5.0)
        with pytest.raises(redis.ConnectionError):
            registry.list_instances("prefill")
        server = EmbeddedRedis(port=port)  # empty, as after a crash without persistence
        wait_until(lambda: registry.list_instances("prefill") == [_info("p1")], 3.0)
        assert hb.reregistrations == 1
        assert flags == ["republish prefixes"]
        assert registry.match_prefix(["p1"], [11, 12]) == {"p1": 0}  # lost with the restart
        assert registry.replace_prefix("p1", [11, 12]) is True
        assert registry.match_prefix(["p1"], [11, 12]) == {"p1": 2}
    finally:
        hb.stop()
        registry.close()
        server.stop()


def test_unreachable_registry_fails_within_timeouts() -> None:
    with EmbeddedRedis() as server:
        url = server.url
    registry = Registry(url, namespace=f"t{uuid.uuid4().hex[:6]}", timeout_s=0.5, retries=2)
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        registry.register(_info("p1"), ttl_s=1.0)
    assert time.monotonic() - start < 5.0

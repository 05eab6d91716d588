from __future__ import annotations

from common.engine.core.block_manager import hash_prefix_blocks
from common.registry import InstanceInfo, Registry


def _register(registry: Registry, *ids: str, ttl_s: float = 10.0) -> None:
    for iid in ids:
        registry.register(InstanceInfo(iid, "prefill", "a:1", "m", block_size=4), ttl_s)


def test_match_counts_leading_blocks(registry: Registry) -> None:
    _register(registry, "p1", "p2", "p3")
    prompt = list(range(100, 118))               # 18 tokens: 4 full blocks of 4
    h = hash_prefix_blocks(prompt, block_size=4)
    assert len(h) == 4
    assert registry.publish_prefix("p1", h[:3], []) is True
    assert registry.publish_prefix("p2", [h[0], h[2], h[3]], []) is True
    assert registry.match_prefix(["p1", "p2", "p3", "gone"], h) == {
        "p1": 3, "p2": 1, "p3": 0, "gone": 0}
    # A different continuation shares only the first block.
    other = hash_prefix_blocks(prompt[:4] + [1, 2, 3, 4], block_size=4)
    assert registry.match_prefix(["p1"], other) == {"p1": 1}
    assert registry.match_prefix(["p1", "p2"], []) == {"p1": 0, "p2": 0}


def test_delta_applies_removals_first(registry: Registry) -> None:
    _register(registry, "p1")
    registry.publish_prefix("p1", [1, 2, 3], [])
    assert registry.publish_prefix("p1", [], [2]) is True
    assert registry.match_prefix(["p1"], [1, 2, 3]) == {"p1": 1}
    # 3 evicted and cached again since the last publish: it stays.
    assert registry.publish_prefix("p1", [2, 3], [3]) is True
    assert registry.match_prefix(["p1"], [1, 2, 3]) == {"p1": 3}
    assert registry.replace_prefix("p1", [2 ** 62, 5]) is True
    assert registry.match_prefix(["p1"], [2 ** 62, 5, 1]) == {"p1": 2}


def test_large_publish(registry: Registry) -> None:
    _register(registry, "p1")
    hashes = list(range(1, 12_001))  # more than one Lua unpack batch
    assert registry.publish_prefix("p1", hashes, []) is True
    assert registry.match_prefix(["p1"], hashes) == {"p1": 12_000}
    assert registry.publish_prefix("p1", [], hashes[6000:]) is True
    assert registry.match_prefix(["p1"], hashes) == {"p1": 6000}


def test_unregistered_instance_writes_nothing(registry: Registry) -> None:
    assert registry.publish_prefix("ghost", [1, 2], []) is False
    assert registry.replace_prefix("ghost", [1, 2]) is False
    assert registry.namespace_keys() == []


def test_prefix_set_disappears_with_the_instance(registry: Registry, wait_until) -> None:
    _register(registry, "p1", ttl_s=1.5)
    registry.publish_prefix("p1", [1, 2], [])
    assert registry.match_prefix(["p1"], [1, 2]) == {"p1": 2}
    wait_until(lambda: registry.namespace_keys() == [], 4.0)
    assert registry.match_prefix(["p1"], [1, 2]) == {"p1": 0}


def test_deregister_removes_prefix_set(registry: Registry) -> None:
    _register(registry, "p1")
    registry.publish_prefix("p1", [1, 2], [])
    registry.deregister("p1")
    assert registry.namespace_keys() == []

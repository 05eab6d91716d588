"""Quarantine: instances hidden from routing until their deadline passes (pure Python)."""

from __future__ import annotations

from common.registry import InstanceInfo
from gateway.quarantine import Quarantine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(i: str) -> InstanceInfo:
    return InstanceInfo(instance_id=i, kind="decode", address=f"127.0.0.1:{i}", model="m")


def test_hidden_until_the_deadline():
    clock = Clock()
    q = Quarantine(5.0, clock=clock)
    everyone = [info("1"), info("2"), info("3")]
    assert q.filter(everyone) == everyone
    q.add("2")
    clock.now += 1.0
    q.add("3")
    assert [i.instance_id for i in q.filter(everyone)] == ["1"]
    assert q.current == ["2", "3"]
    clock.now += 4.0  # 2's deadline (105.0) is reached, 3's (106.0) not
    assert [i.instance_id for i in q.filter(everyone)] == ["1", "2"]
    clock.now += 1.0
    assert q.filter(everyone) == everyone and q.current == [] and q.total == 2

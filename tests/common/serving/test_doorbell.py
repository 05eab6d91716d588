"""The delivery doorbell: a ring reaches the listener of that decode address on the event loop's
thread, malformed datagrams are dropped without stopping the reader, and a ring to an address
nobody listens on fails quietly; one address has one doorbell (and one express socket)."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from common.serving.doorbell import DoorbellListener, DoorbellSender, socket_name
from common.serving.express import ExpressListener


def test_rings_reach_the_listener_of_that_address_on_the_loop_thread():
    address = f"127.0.0.1:{id(object())}"

    async def scenario():
        got: list[tuple[dict, bool]] = []
        arrived = asyncio.Event()
        loop_thread = threading.get_ident()

        def on_ring(message):
            got.append((message, threading.get_ident() == loop_thread))
            if len(got) == 2:
                arrived.set()

        listener = DoorbellListener(address, on_ring).start()
        sender = DoorbellSender()
        try:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            raw.sendto(b"not json", socket_name(address))  # dropped, the reader goes on
            raw.close()
            assert sender.ring(address, {"request_id": "a", "n": 1})
            assert sender.ring(address, {"request_id": "b", "descriptor_json": "x" * 100_000})
            await asyncio.wait_for(arrived.wait(), 5)
            assert not sender.ring(address + "0", {"request_id": "c"})  # nobody there
        finally:
            sender.close()
            listener.close()
        return got

    got = asyncio.run(scenario())
    assert [m["request_id"] for m, _ in got] == ["a", "b"] and all(on_loop for _, on_loop in got)
    assert len(got[1][0]["descriptor_json"]) == 100_000


@pytest.mark.parametrize("listener", [
    lambda address: DoorbellListener(address, lambda m: None),
    lambda address: ExpressListener(address, lambda m, a: None)], ids=["doorbell", "express"])
def test_one_address_has_one_listener(listener):
    address = f"127.0.0.1:{id(object())}"

    async def scenario():
        first = listener(address).start()
        try:
            try:
                listener(address)
            except OSError:
                return True
            return False
        finally:
            first.close()

    assert asyncio.run(scenario())

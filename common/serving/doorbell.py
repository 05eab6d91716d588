"""The delivery doorbell: a prefill service tells a decode service on its own host that a
request's KV is ready with one Unix datagram, beside the DecodeService.Deliver call.

Why: one Python gRPC call costs 1.4-2.0 ms after its threads have idled through a prefill (the
C core's poller thread wakes, then the event loop, on each end: bench/grpc_floor.py), against
~0.1-0.25 ms for a raw socket's wake-up. The doorbell's datagram reaches the decode service's
event loop directly (the socket is one of the loop's readers), which starts the pull at once;
the Deliver call, sent right after it, keeps every rule it had (its deadline is the lease, its
end releases the prefill's blocks) and only waits for that pull's outcome to answer.

Rules:
- Same host and network namespace only: the socket lives in Linux's abstract namespace under
  a name made from the decode service's gRPC address. A ring that reaches nobody (another host,
  another container, a decode service without a doorbell) is dropped silently; the Deliver call
  does the work as before.
- Plaintext stacks only: the datagram carries no credentials, like a plaintext gRPC port. A
  decode service that serves TLS does not open a doorbell (decode_service/server.py).
- A ring is a hint: the decode side acts on it only for a request whose blocks are reserved and
  whose KV nobody pulls yet, and only until the deadline the ring carries (the moment the
  prefill's Deliver call, started after the ring, can end at the earliest); everything else is
  left to the Deliver call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

from common.serving.datagram import drain

log = logging.getLogger("splitserve.doorbell")

MAX_DATAGRAM = 1 << 20  # a descriptor with every transport's offer is a few KiB


def socket_name(decode_address: str) -> bytes:
    """The abstract-namespace name of the doorbell of the decode service at decode_address."""
    return b"\0splitserve-doorbell/" + decode_address.encode()[:80]


class DoorbellSender:
    """Rings doorbells; one unbound datagram socket, never blocking."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def ring(self, decode_address: str, message: dict[str, Any]) -> bool:
        """Send message (JSON-able) to that decode service's doorbell; False when it did not
        go out (no such doorbell here, its queue full, too large)."""
        try:
            self._sock.sendto(json.dumps(message).encode(), socket_name(decode_address))
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._sock.close()


class DoorbellListener:
    """A decode service's doorbell: each datagram, decoded from JSON, goes to on_ring on the
    event loop's thread."""

    def __init__(self, decode_address: str, on_ring: Callable[[dict[str, Any]], None]):
        self.name = socket_name(decode_address)
        self._on_ring = on_ring
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MAX_DATAGRAM)
        self._sock.bind(self.name)
        self._sock.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> DoorbellListener:
        """Listen on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._read)
        return self

    def _read(self) -> None:
        drain(self._sock, MAX_DATAGRAM, self._on_datagram)

    def _on_datagram(self, data: bytes, _sender) -> None:
        try:
            message = json.loads(data)
        except ValueError:
            log.warning("doorbell: dropped a datagram that is not JSON (%d bytes)", len(data))
            return
        try:
            self._on_ring(message)
        except Exception:  # a malformed ring must not stop the reader
            log.exception("doorbell: a ring failed")

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

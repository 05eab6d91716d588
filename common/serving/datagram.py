"""What the same-host datagram paths share (common/serving/doorbell.py, express.py): reading
every datagram a non-blocking socket holds, and opening a listener only where it may serve."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from common.serving.tls import TlsConfig

T = TypeVar("T")


def drain(sock: socket.socket, size: int, on_datagram: Callable[[bytes, Any], None]) -> None:
    """Hand every datagram waiting on the non-blocking `sock` to on_datagram(data, sender
    address) (an event loop's reader callback)."""
    while True:
        try:
            data, address = sock.recvfrom(size)
        except (BlockingIOError, InterruptedError):
            return
        on_datagram(data, address)


def open_listener(enabled: bool, tls: TlsConfig, make: Callable[[], T], log: logging.Logger,
                  what: str, without: str) -> T | None:
    """make() unless turned off or the service serves TLS (a datagram carries no credentials);
    a name already taken leaves it off with a warning that says `without`."""
    if not enabled or tls.serves_tls:
        return None
    try:
        return make()
    except OSError as e:
        log.warning("no %s (%s): %s", what, e, without)
        return None

"""The express lane: a gateway starts a prompt on a prefill service of its own host with one Unix
datagram, and gets the first token back with one, beside the Prefill call.

Why: a Python gRPC hop costs 1.4-2.0 ms after its threads have idled (bench/grpc_floor.py),
against ~0.1-0.2 ms for a raw socket's; the gateway -> prefill call is on every request's TTFT
path twice (the request out, the first token back). The datagram reaches the prefill service's
event loop directly (its socket is one of the loop's readers), which submits the prompt at once;
the engine thread sends the first token back the moment it is sampled, without waiting for the
service's event loop (prefill_service/servicer.py).

Rules:
- The Prefill call always follows the datagram and stays the request's contract: it adopts the
  work the datagram started (or starts it, when no datagram came), reports every error, carries
  cancellation, the delivery and the second message. The datagram and its reply are hints: a
  datagram that is lost, too large, malformed, late (its call came first) or refused by the
  engine changes nothing but the timing. Work that no call adopts within the call's deadline (at
  most ADOPT_WITHIN_S) is aborted, so nothing stays held.
- The gateway takes the first message from whichever comes first and drops the other copy; both
  are the same PrefillResponse, built by one function.
- Same host and network namespace only (Linux abstract sockets named by the prefill service's
  gRPC address); plaintext stacks only: a datagram carries no credentials, so a prefill service
  serving TLS opens no express socket and a gateway dialling TLS sends none.

The decode side has a lane for replies only: a Decode call names the gateway's decode reply
socket (DecodeRequest.express_reply_to), and the decode engine's thread sends the stream's
first message there as one datagram (ExpressDecodeReply) the moment its tokens are sampled,
beside the stream's copy: the second token of a handed-off request (the first of a local
prefill) skips the decode service's event loop and the gRPC hop (decode_service/servicer.py).
The same rules hold: the stream is the contract, the datagram a hint, the first copy wins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable

from google.protobuf.message import DecodeError, Message

from common.serving.datagram import drain
from protos.splitserve.v1 import decode_pb2, prefill_pb2

log = logging.getLogger("splitserve.express")

# A datagram larger than the socket's send buffer (net.core.wmem_max, ~208 KiB by default: a
# prompt of ~50k tokens) does not go out; its Prefill call does the work alone.
MAX_DATAGRAM = 1 << 20
# The longest an express start waits for its Prefill call (sent right after the datagram).
ADOPT_WITHIN_S = 10.0


def listen_name(prefill_address: str) -> bytes:
    """The abstract-namespace name of the express socket of the prefill service at that
    address."""
    return b"\0splitserve-express/" + prefill_address.encode()[:80]


def _datagram_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MAX_DATAGRAM)
    sock.setblocking(False)
    return sock


class _Replies:
    """One reply socket of the gateway's: each datagram, parsed as `kind`, resolves the future
    of its request id (`unpack` gives the request id and what the future gets)."""

    def __init__(self, name: bytes, kind: type[Message],
                 unpack: Callable[[Message], tuple[str, Message]]):
        self.name = name
        self.sock = _datagram_socket()
        self.sock.bind(name)
        self._kind = kind
        self._unpack = unpack
        self._waiting: dict[str, asyncio.Future] = {}

    def expect(self, loop: asyncio.AbstractEventLoop, request_id: str) -> asyncio.Future:
        future = self._waiting[request_id] = loop.create_future()
        return future

    def forget(self, request_id: str) -> None:
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def read(self) -> None:
        drain(self.sock, MAX_DATAGRAM, self._on_reply)

    def _on_reply(self, data: bytes, _sender) -> None:
        try:
            request_id, reply = self._unpack(self._kind.FromString(data))
        except DecodeError:
            log.warning("express: dropped a reply that does not parse as %s (%d bytes)",
                        self._kind.__name__, len(data))
            return
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.sock.fileno())
        for rid in list(self._waiting):
            self.forget(rid)
        self.sock.close()


class ExpressClient:
    """The gateway's end: sends ExpressPrefill datagrams from a socket of its own (named for
    this process) and hands each reply to the future of its request id; decode services' first
    messages (ExpressDecodeReply) come to a second socket (decode_name)."""

    def __init__(self) -> None:
        self.name = f"\0splitserve-express-reply/{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self._prefill = _Replies(self.name, prefill_pb2.PrefillResponse,
                                 lambda r: (r.request_id, r))
        self._sock = self._prefill.sock
        self.decode_name = self.name + b"/decode"
        self._decode = _Replies(self.decode_name, decode_pb2.ExpressDecodeReply,
                                lambda r: (r.request_id, r.response))
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> ExpressClient:
        """Read replies on the running event loop."""
        self._loop = asyncio.get_running_loop()
        for replies in (self._prefill, self._decode):
            self._loop.add_reader(replies.sock.fileno(), replies.read)
        return self

    def send(self, prefill_address: str, message: prefill_pb2.ExpressPrefill,
             ) -> asyncio.Future[prefill_pb2.PrefillResponse] | None:
        """The future of the first PrefillResponse, or None when the datagram did not go out (no
        express socket at that address on this host, its queue full, too large)."""
        if self._loop is None:
            return None
        try:
            self._sock.sendto(message.SerializeToString(), listen_name(prefill_address))
        except OSError:
            return None
        return self._prefill.expect(self._loop, message.request.request_id)

    def forget(self, request_id: str) -> None:
        self._prefill.forget(request_id)

    def expect_decode(self, request_id: str) -> asyncio.Future[decode_pb2.DecodeResponse] | None:
        """The future of a Decode stream's first message, for a Decode call sent with
        express_reply_to=decode_name (None before start())."""
        return None if self._loop is None else self._decode.expect(self._loop, request_id)

    def forget_decode(self, request_id: str) -> None:
        self._decode.forget(request_id)

    def close(self) -> None:
        for replies in (self._prefill, self._decode):
            replies.close(self._loop)


class ExpressListener:
    """A prefill service's end: each ExpressPrefill goes to on_request (with the address to reply
    to, b"" for none) on the event loop's thread; reply() may be called from any thread."""

    def __init__(self, prefill_address: str,
                 on_request: Callable[[prefill_pb2.ExpressPrefill, bytes], None]):
        self.name = listen_name(prefill_address)
        self._on_request = on_request
        self._sock = _datagram_socket()
        self._sock.bind(self.name)
        self._reply = ExpressReplier()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> ExpressListener:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._read)
        return self

    def reply(self, address: bytes, response: prefill_pb2.PrefillResponse) -> bool:
        """Send the first PrefillResponse to the gateway at address; False if it did not go out."""
        return self._reply.send(address, response)

    def _read(self) -> None:
        drain(self._sock, MAX_DATAGRAM, self._on_datagram)

    def _on_datagram(self, data: bytes, address) -> None:
        try:
            message = prefill_pb2.ExpressPrefill.FromString(data)
        except DecodeError:
            log.warning("express: dropped a datagram that is not an ExpressPrefill (%d bytes)",
                        len(data))
            return
        if not isinstance(address, bytes):
            address = b""  # an unbound sender: the work starts, the reply has nowhere to go
        try:
            self._on_request(message, address)
        except Exception:  # a bad datagram must not stop the reader
            log.exception("express: starting request %r failed", message.request.request_id)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._reply.close()


class ExpressReplier:
    """Sends replies to gateways' reply sockets from an unbound socket of its own: a prefill
    service's first PrefillResponse (ExpressListener.reply), a decode service's first stream
    message (reply_decode). Any thread may call them (the engine's does)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, address: bytes, message: Message) -> bool:
        """False if it did not go out (nobody listening, the queue full, too large)."""
        try:
            self._sock.sendto(message.SerializeToString(), address)
            return True
        except OSError:
            return False

    def reply_decode(self, address: bytes, request_id: str,
                     response: decode_pb2.DecodeResponse) -> bool:
        return self.send(address, decode_pb2.ExpressDecodeReply(request_id=request_id,
                                                                 response=response))

    def close(self) -> None:
        self._sock.close()

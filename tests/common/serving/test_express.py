"""The express lane's sockets (common/serving/express.py): a datagram reaches the listener of
that prefill address on the event loop's thread, its reply (sent from another thread) resolves
the future of its request id, malformed datagrams are dropped without stopping either reader,
and a datagram to an address nobody listens on is refused quietly."""

from __future__ import annotations

import asyncio
import socket
import threading

from common.serving.express import ExpressClient, ExpressListener, ExpressReplier, listen_name
from protos.splitserve.v1 import decode_pb2, prefill_pb2


def _message(rid: str, prompt_len: int = 8) -> prefill_pb2.ExpressPrefill:
    return prefill_pb2.ExpressPrefill(
        request=prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=range(prompt_len),
                                           decode_address="127.0.0.1:1"),
        timeout_s=5.0, traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


def test_a_datagram_and_its_reply():
    address = f"127.0.0.1:{id(object())}"

    async def scenario():
        got: list[tuple[prefill_pb2.ExpressPrefill, bool]] = []
        loop_thread = threading.get_ident()
        listener: ExpressListener

        def on_request(message, reply_to):
            got.append((message, threading.get_ident() == loop_thread))
            rid = message.request.request_id
            # The prefill service replies from its engine thread.
            threading.Thread(target=listener.reply, args=(reply_to, prefill_pb2.PrefillResponse(
                request_id=rid, first_token_id=len(rid)))).start()

        listener = ExpressListener(address, on_request).start()
        client = ExpressClient().start()
        try:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            raw.sendto(b"\xff\xff not a message", listen_name(address))  # dropped
            raw.sendto(b"\xff\xff not a reply", client.name)  # dropped
            raw.close()
            first = client.send(address, _message("a"))
            second = client.send(address, _message("bb", prompt_len=20_000))
            replies = await asyncio.wait_for(asyncio.gather(first, second), 5)
            assert client.send(address + "0", _message("c")) is None  # nobody there
            forgotten = client.send(address, _message("d"))
            client.forget("d")
            assert forgotten.cancelled()
        finally:
            client.close()
            listener.close()
        return got, replies

    got, replies = asyncio.run(scenario())
    assert [m.request.request_id for m, _ in got[:2]] == ["a", "bb"]
    assert all(on_loop for _, on_loop in got)
    assert list(got[1][0].request.prompt_token_ids) == list(range(20_000))
    assert got[0][0].timeout_s == 5.0 and got[0][0].traceparent.startswith("00-4bf9")
    assert [(r.request_id, r.first_token_id) for r in replies] == [("a", 1), ("bb", 2)]


def test_a_decode_services_first_message_by_datagram():
    """A decode service's engine thread sends a stream's first message to the gateway's decode
    reply socket; it resolves that request's future, malformed or unawaited replies are dropped,
    and a forgotten request's future is cancelled."""
    async def scenario():
        client = ExpressClient().start()
        replier = ExpressReplier()
        try:
            waiting = client.expect_decode("r1")
            forgotten = client.expect_decode("r2")
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            raw.sendto(b"\xff\xff not a reply", client.decode_name)  # dropped
            raw.close()
            message = decode_pb2.DecodeResponse(token_ids=[7, 8], text="ab", index=0,
                                                handoff_critical_ms=1.5)
            assert replier.reply_decode(client.decode_name, "nobody-waits", message)  # dropped
            sent = threading.Thread(target=replier.reply_decode,
                                    args=(client.decode_name, "r1", message))
            sent.start()
            got = await asyncio.wait_for(waiting, 5)
            sent.join()
            client.forget_decode("r2")
            assert forgotten.cancelled()
            assert not replier.reply_decode(b"\0splitserve-express-reply/nobody", "r3", message)
            return got, message
        finally:
            replier.close()
            client.close()

    got, sent = asyncio.run(scenario())
    assert got == sent

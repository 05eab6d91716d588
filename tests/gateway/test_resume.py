"""ResumableStreams: replay after a reconnect, live following, retention and abandonment (asyncio,
with a source that releases its messages when the test says so)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.errors import ServiceError, SplitserveError
from gateway.resume import ResumableStreams
from protos.splitserve.v1 import generation_pb2, types_pb2

Msg = generation_pb2.GenerateStreamResponse


class Source:
    """Yields the given messages one per release(); records whether it was closed early."""

    def __init__(self, messages: list[Msg], error: Exception | None = None):
        self.messages = messages
        self.error = error
        self.gate = asyncio.Semaphore(0)
        self.closed_early = False

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    async def run(self):
        finished = False
        try:
            for msg in self.messages:
                await self.gate.acquire()
                yield msg
            if self.error is not None:
                raise self.error
            finished = True
        finally:
            self.closed_early = not finished and self.error is None


def messages() -> list[Msg]:
    """Tokens 0..5 in messages of 1, 2, 0 (text only), 2 and 1 tokens, then the final one."""
    groups = [[0], [1, 2], [], [3, 4], [5]]
    out = [Msg(request_id="r", token_ids=g, text="".join(f"<{t}>" for t in g) or "~")
           for g in groups]
    out[-1].finish_reason = types_pb2.FINISH_REASON_LENGTH
    return out


async def take(agen, n: int) -> list[Msg]:
    got = []
    async for msg in agen:
        got.append(msg)
        if len(got) == n:
            break
    return got


def tokens(msgs: list[Msg]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_reconnect_replays_what_follows_and_then_follows_live():
    async def main() -> None:
        streams = ResumableStreams(retention_s=5.0)
        source = Source(messages())
        streams.open("r", source.run())
        first = streams.follow("r")
        source.release(2)
        got = await take(first, 2)
        assert tokens(got) == [0, 1, 2]
        await first.aclose()  # the client's connection drops
        source.release(1)     # the request goes on without a client
        await asyncio.sleep(0.05)
        again = streams.follow("r", num_tokens_received=3)
        source.release(2)
        rest = [m async for m in again]
        assert [m.text for m in rest] == ["~", "<3><4>", "<5>"]
        assert rest[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
        assert not source.closed_early
        # Late reconnects within the retention window get the tail again, from any boundary.
        assert tokens([m async for m in streams.follow("r", 5)]) == [5]
        assert [m async for m in streams.follow("r", 6)] == []
        await streams.close()

    asyncio.run(main())


def test_bad_resume_points_and_unknown_ids():
    async def main() -> None:
        streams = ResumableStreams(retention_s=5.0)
        source = Source(messages())
        streams.open("r", source.run())
        source.release(5)
        assert len([m async for m in streams.follow("r")]) == 5
        cases = [("r", 2, grpc.StatusCode.INVALID_ARGUMENT, "falls inside a message"),
                 ("r", 7, grpc.StatusCode.OUT_OF_RANGE, "has produced 6 tokens so far, not 7"),
                 ("nope", 0, grpc.StatusCode.NOT_FOUND, "no resumable request 'nope'")]
        for rid, n, code, text in cases:
            with pytest.raises(SplitserveError) as err:
                await anext(streams.follow(rid, n))
            assert err.value.grpc_status == code.name and text in err.value.message
        with pytest.raises(ServiceError) as err:
            streams.open("r", Source([]).run())
        assert err.value.grpc_status == "ALREADY_EXISTS"
        await streams.close()

    asyncio.run(main())


def test_the_request_error_reaches_every_follower():
    async def main() -> None:
        streams = ResumableStreams(retention_s=5.0)
        boom = ServiceError(grpc.StatusCode.UNAVAILABLE, "no decode instance is left")
        source = Source(messages()[:1], error=boom)
        streams.open("r", source.run())
        source.release(1)
        for _ in range(2):
            with pytest.raises(ServiceError) as err:
                [m async for m in streams.follow("r")]
            assert err.value is boom
        await streams.close()

    asyncio.run(main())


def test_a_request_nobody_reattaches_to_is_cancelled_then_forgotten():
    async def main() -> None:
        streams = ResumableStreams(retention_s=0.2)
        source = Source(messages())
        streams.open("r", source.run())
        follower = streams.follow("r")
        source.release(1)
        await take(follower, 1)
        await follower.aclose()
        for _ in range(100):  # the retention window, then the reaper's pass
            if "r" not in streams:
                break
            await asyncio.sleep(0.05)
        assert "r" not in streams and source.closed_early and streams.abandoned == 1
        with pytest.raises(ServiceError) as err:
            await anext(streams.follow("r"))
        assert err.value.grpc_status == "NOT_FOUND"
        # A finished stream is also dropped once its window has passed.
        done = Source(messages())
        streams.open("d", done.run())
        done.release(5)
        assert len([m async for m in streams.follow("d")]) == 5
        for _ in range(100):
            if "d" not in streams:
                break
            await asyncio.sleep(0.05)
        assert "d" not in streams and streams.abandoned == 1
        await streams.close()

    asyncio.run(main())


def test_n_choices_resume_exactly_by_messages_received():
    """n > 1: a choice may end in a message without tokens; a resume point that counts messages
    too replays exactly what follows, and one that does not match its tokens is refused."""
    async def main() -> None:
        streams = ResumableStreams(retention_s=5.0)
        msgs = [Msg(request_id="r", token_ids=[0], index=0),
                Msg(request_id="r", token_ids=[1], index=1),
                Msg(request_id="r", index=1, finish_reason=types_pb2.FINISH_REASON_ABORT),
                Msg(request_id="r", token_ids=[2], index=0,
                    finish_reason=types_pb2.FINISH_REASON_LENGTH)]
        source = Source(msgs)
        streams.open("r", source.run())
        source.release(4)
        assert len([m async for m in streams.follow("r")]) == 4
        # Two tokens alone resume at the tokenless finish (sent again); three messages do not.
        assert [m.index for m in [m async for m in streams.follow("r", 2)]] == [1, 0]
        rest = [m async for m in streams.follow("r", 2, num_messages_received=3)]
        assert [(m.index, list(m.token_ids)) for m in rest] == [(0, [2])]
        assert [m async for m in streams.follow("r", 3, num_messages_received=4)] == []
        cases = [(1, 3, grpc.StatusCode.INVALID_ARGUMENT, "the first 3 messages hold 2 tokens"),
                 (3, 5, grpc.StatusCode.OUT_OF_RANGE, "has sent 4 messages so far, not 5")]
        for n, m, code, text in cases:
            with pytest.raises(SplitserveError) as err:
                await anext(streams.follow("r", n, num_messages_received=m))
            assert err.value.grpc_status == code.name and text in err.value.message
        await streams.close()

    asyncio.run(main())

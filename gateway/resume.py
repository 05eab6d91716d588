"""Resumable client streams: a request opened with `resumable` keeps generating when its client's
connection drops, and the client reconnects with (request id, tokens received) to get the rest.

    open(rid, source)   a pump task copies the request's messages into its StreamLog
    follow(rid, n)      replays the messages after the first n tokens, then follows live ones

Retention rule: a log lives while its request runs with a client attached. When the last client
detaches before the end, the request keeps running for retention_s; if nobody reattaches by
then, it is cancelled (its blocks are freed on every service as for any cancelled request). A
finished log is kept retention_s for late reconnects, then dropped. Messages are replayed whole:
a resume point must fall between two messages (a client that received a message has all its
tokens and text). With n > 1 the log holds every choice's messages in the order they went out,
and a resume point counts tokens over all of them; a client also counting messages
(Resume.num_messages_received) resumes exactly, even after a choice's message without tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from common.errors import InvalidRequestError, RequestCancelledError, ServiceError
from protos.splitserve.v1 import generation_pb2

log = logging.getLogger("splitserve.gateway.resume")

Message = generation_pb2.GenerateStreamResponse


@dataclass(slots=True)
class StreamLog:
    request_id: str
    messages: list[Message] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # token index at which each message starts
    num_tokens: int = 0
    done: bool = False
    error: BaseException | None = None
    followers: int = 0
    expires_at: float | None = None  # when the log (and a detached request) is dropped
    pump: asyncio.Task | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def first_message_at(self, num_tokens_received: int,
                         num_messages_received: int | None = None) -> int:
        """Index of the first message the client lacks, having received that many tokens (and,
        when given, that many messages: the exact point, checked against the tokens)."""
        if num_messages_received is not None:
            if num_messages_received > len(self.messages):
                raise ServiceError(grpc.StatusCode.OUT_OF_RANGE,
                                   f"request {self.request_id!r} has sent "
                                   f"{len(self.messages)} messages so far, not "
                                   f"{num_messages_received}")
            tokens = (self.starts[num_messages_received] if num_messages_received
                      < len(self.messages) else self.num_tokens)
            if tokens != num_tokens_received:
                raise InvalidRequestError(
                    f"the first {num_messages_received} messages hold {tokens} tokens, not "
                    f"{num_tokens_received}")
            return num_messages_received
        if num_tokens_received > self.num_tokens:
            raise ServiceError(grpc.StatusCode.OUT_OF_RANGE,
                               f"request {self.request_id!r} has produced {self.num_tokens} "
                               f"tokens so far, not {num_tokens_received}")
        for i, start in enumerate(self.starts):
            if start >= num_tokens_received:
                return i
            if start + len(self.messages[i].token_ids) > num_tokens_received:
                raise InvalidRequestError(
                    f"resume point {num_tokens_received} falls inside a message (tokens "
                    f"{start}..{start + len(self.messages[i].token_ids) - 1}); resume from the "
                    "number of tokens in the messages received whole")
        return len(self.messages)


class ResumableStreams:
    def __init__(self, retention_s: float, clock: Callable[[], float] = time.monotonic):
        if retention_s <= 0:
            raise ValueError(f"retention must be positive, got {retention_s}")
        self.retention_s = retention_s
        self._clock = clock
        self._logs: dict[str, StreamLog] = {}
        self._reaper: asyncio.Task | None = None
        self.abandoned = 0  # requests cancelled because no client came back in time

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._logs

    def open(self, request_id: str, source: AsyncIterator[Message]) -> StreamLog:
        """Start pumping a new request's messages into its log."""
        if request_id in self._logs:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {request_id!r} is retained for resumption; "
                               "use another id")
        entry = StreamLog(request_id)
        self._logs[request_id] = entry
        entry.pump = asyncio.get_running_loop().create_task(self._pump(entry, source))
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return entry

    async def follow(self, request_id: str, num_tokens_received: int = 0,
                     num_messages_received: int | None = None) -> AsyncIterator[Message]:
        """The messages after the first num_tokens_received tokens (the first
        num_messages_received messages, when given), live until the end; raises what the
        request ended with (a SplitserveError, an internal call's error)."""
        entry = self._logs.get(request_id)
        if entry is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"no resumable request {request_id!r} is retained (unknown, not "
                               f"opened as resumable, or ended more than {self.retention_s:.0f} "
                               "s ago)")
        i = entry.first_message_at(num_tokens_received, num_messages_received)
        entry.followers += 1
        if not entry.done:  # a finished log's window runs from its end, whoever reads it
            entry.expires_at = None
        try:
            while True:
                async with entry.changed:
                    while i >= len(entry.messages) and not entry.done:
                        await entry.changed.wait()
                    batch = entry.messages[i:]
                if not batch:
                    if entry.error is not None:
                        raise entry.error
                    return
                for msg in batch:
                    yield msg
                i += len(batch)
        finally:
            entry.followers -= 1
            if entry.followers == 0 and entry.expires_at is None:
                entry.expires_at = self._clock() + self.retention_s

    async def _pump(self, entry: StreamLog, source: AsyncIterator[Message]) -> None:
        try:
            async for msg in source:
                async with entry.changed:
                    entry.starts.append(entry.num_tokens)
                    entry.messages.append(msg)
                    entry.num_tokens += len(msg.token_ids)
                    entry.changed.notify_all()
        except asyncio.CancelledError:
            entry.error = RequestCancelledError(
                f"request {entry.request_id!r} was cancelled: no client reattached within "
                f"{self.retention_s:.0f} s")
        except Exception as exc:  # handed to every follower
            entry.error = exc
        finally:
            async with entry.changed:
                entry.done = True
                if entry.followers == 0:
                    entry.expires_at = self._clock() + self.retention_s
                entry.changed.notify_all()

    async def _reap(self) -> None:
        """Drop expired logs, cancelling requests nobody reattached to; ends when none is left."""
        while self._logs:
            now = self._clock()
            for rid, entry in list(self._logs.items()):
                if entry.expires_at is None or entry.expires_at > now:
                    continue
                if not entry.done and entry.pump is not None:
                    log.info("request %s: no client reattached within %.1f s; cancelling it",
                             rid, self.retention_s)
                    self.abandoned += 1
                    entry.pump.cancel()
                    await asyncio.gather(entry.pump, return_exceptions=True)
                del self._logs[rid]
            await asyncio.sleep(min(1.0, self.retention_s / 4))

    async def close(self) -> None:
        """Cancel every pump and the reaper (gateway shutdown)."""
        tasks = [e.pump for e in self._logs.values() if e.pump is not None]
        if self._reaper is not None:
            tasks.append(self._reaper)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._logs.clear()

"""Request migration: a request whose prefill or decode service fails is resumed on another one,
and the client's stream goes on as if nothing happened.

    attempt 1:  Relay.run(prompt)                 -> t0 t1 t2 ... tk   X decode killed (UNAVAILABLE)
    attempt 2:  Relay.run(prompt, outputs [t0 .. tk]) -> t(k+1) ...      re-prefilled elsewhere

The continuation is the same request carrying the tokens the client already has as outputs
(PrefillRequest/DecodeRequest.output_token_ids): the services compute their KV after the prompt's
and count them as outputs for max/min tokens, penalties and seeded draws, so no token is repeated
or skipped and the output equals an undisturbed run's, sampled or not. Once migrated, the gateway
writes the text itself (TextReplay), so stop strings see the whole output.

A request with n > 1 that fails after tokens reached the client goes on as one single-choice
request per unfinished choice, run side by side: choice i's continuation has its settings
(SamplingParams.choice: seed + i), its own delivered tokens as outputs and its own text replay,
so it samples what the undisturbed choice would have; its messages keep index i, and the
stream's last message carries the usage of every choice. (The prompt's KV is then computed once
per resumed choice, where the first attempt shared it: a failure path.)

Which failures are retried: UNAVAILABLE from an internal call (the service died or is shutting
down), an unreachable registry, and no instance being registered. The failed instance is probed
(gRPC health); if it does not answer SERVING it goes into quarantine (no request is routed there
for a while). Retries are bounded by --max-retries per request and the request's deadline; with no
usable instance, the gateway waits up to --retry-wait-s for one to (re)appear, then answers
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import SplitserveError, UnavailableError
from common.registry import InstanceInfo
from common.serving.proto_convert import ms
from common.serving.tls import TlsConfig, aio_channel
from common.text.detokenizer import Decoder
from gateway.config import MigrationPolicy
from gateway.frontend import PreparedRequest
from gateway.instances import Instances
from gateway.quarantine import Quarantine
from gateway.relay import Inflight, Relay
from gateway.text_replay import TextReplay
from protos.splitserve.v1 import generation_pb2, types_pb2

log = logging.getLogger("splitserve.gateway.migration")

MAX_PAUSE_S = 0.5
PROBE_TIMEOUT_S = 0.5  # health check of an instance whose call failed
BACKOFF_S = 0.05  # first pause while waiting for an instance, doubled up to MAX_PAUSE_S


@dataclass(slots=True)
class MigrationCounters:
    migrations: int = 0     # resumptions elsewhere after tokens had reached the client
    retries: int = 0        # attempts started again before any token went out
    gave_up: int = 0        # requests answered UNAVAILABLE after a failure


class Delivery:
    """What the client has received, and the rewriting of later messages after a migration."""

    def __init__(self, req: PreparedRequest, arrival: float, tokenizer: Decoder | None):
        self.req = req
        self.arrival = arrival
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self.ttft_ms = 0.0
        self.migrations = 0
        self.replay: TextReplay | None = None
        self.pending_text = ""  # text of delivered tokens the client has not seen yet
        self.finished = False
        self.unfinished = req.params.n  # choices whose finish has not been passed on
        # Per choice (n > 1): the tokens and text delivered, and whether its finish went out.
        self.choice_tokens: list[list[int]] = [[] for _ in range(req.params.n)]
        self.choice_text = [""] * req.params.n
        self.choice_done = [False] * req.params.n

    def continuation(self) -> PreparedRequest:
        """The request that generates what the client still lacks: the same prompt and
        settings, with the delivered tokens as outputs (stop strings left to the replay)."""
        if not self.token_ids:
            return self.req
        stop = [] if self.tokenizer is not None else self.req.params.stop
        params_pb = types_pb2.SamplingParams()
        params_pb.CopyFrom(self.req.params_pb)
        del params_pb.stop[:]
        params_pb.stop.extend(stop)
        return dataclasses.replace(self.req, params=dataclasses.replace(self.req.params, stop=stop),
                                   params_pb=params_pb, output_token_ids=tuple(self.token_ids))

    def choice_delivery(self, index: int) -> Delivery:
        """n > 1: choice `index` as a single-choice request of its own (seed + index), with
        the tokens and text it has delivered and its migration started (see the module
        docstring)."""
        params = self.req.params.choice(index)
        params_pb = types_pb2.SamplingParams()
        params_pb.CopyFrom(self.req.params_pb)
        params_pb.n = 1
        if params.seed is not None:
            params_pb.seed = params.seed
        if params.prompt_logprobs is None:
            params_pb.ClearField("prompt_logprobs")
        one = Delivery(dataclasses.replace(self.req, params=params, params_pb=params_pb),
                       self.arrival, self.tokenizer)
        one.token_ids = list(self.choice_tokens[index])
        one.text = self.choice_text[index]
        one.ttft_ms = self.ttft_ms
        one.start_migration()
        return one

    def start_migration(self) -> None:
        self.migrations += 1
        if self.tokenizer is None or self.replay is not None or self.req.params.n > 1:
            return  # n > 1: each choice's own Delivery replays its text (choice_delivery)
        self.replay = TextReplay(self.tokenizer, self.req.prompt_token_ids, self.req.params)
        for token in self.token_ids:
            self.replay.add(token)
        # With stop strings the relay leaves the first token's text to the decode service; if
        # that one died first, the client still lacks it.
        if self.replay.text.startswith(self.text):
            self.pending_text = self.replay.text[len(self.text):]
        else:
            log.warning("request %s: delivered text is not what the tokens decode to",
                        self.req.request_id)

    def pass_on(self, msg: generation_pb2.GenerateStreamResponse,
                ) -> generation_pb2.GenerateStreamResponse:
        """The message to send for one the relay produced (after a migration: text rewritten,
        cut at a stop string, usage and timings of the whole request)."""
        if self.migrations and self.replay is not None:
            msg = self._retext(msg)
        if msg.token_ids and not self.ttft_ms:
            self.ttft_ms = ms(time.monotonic() - self.arrival)
        self.token_ids.extend(msg.token_ids)
        self.text += msg.text
        if self.req.params.n > 1:
            self.choice_tokens[msg.index].extend(msg.token_ids)
            self.choice_text[msg.index] += msg.text
            self.choice_done[msg.index] |= bool(msg.finish_reason)
        self.unfinished -= bool(msg.finish_reason)
        if msg.finish_reason and not self.unfinished:
            self.finished = True
            if self.migrations:
                self._fix_totals(msg)
        return msg

    def _retext(self, msg: generation_pb2.GenerateStreamResponse,
                ) -> generation_pb2.GenerateStreamResponse:
        assert self.replay is not None
        text, self.pending_text = self.pending_text, ""
        tokens = list(msg.token_ids)
        ending = msg.finish_reason not in (types_pb2.FINISH_REASON_UNSPECIFIED,
                                           types_pb2.FINISH_REASON_ABORT)
        for i, token in enumerate(tokens):
            emit, stopped = self.replay.add(token, finishing=ending and i == len(tokens) - 1)
            text += emit
            if stopped:
                out = generation_pb2.GenerateStreamResponse(
                    request_id=msg.request_id, token_ids=tokens[:i + 1], text=text,
                    finish_reason=types_pb2.FINISH_REASON_STOP, usage=msg.usage,
                    timings=msg.timings, logprobs=msg.logprobs[:i + 1])
                out.timings.total_ms = ms(time.monotonic() - self.arrival)
                return out
        out = generation_pb2.GenerateStreamResponse()
        out.CopyFrom(msg)
        out.text = text
        return out

    def _fix_totals(self, msg: generation_pb2.GenerateStreamResponse) -> None:
        prompt = len(self.req.prompt_token_ids)
        msg.usage.num_cached_tokens = min(msg.usage.num_cached_tokens, prompt)
        msg.usage.prompt_tokens = prompt
        msg.usage.completion_tokens = len(self.token_ids)
        msg.timings.ttft_ms = self.ttft_ms
        msg.timings.num_migrations = self.migrations


class Migrator:
    def __init__(self, relay: Relay, instances: Instances, quarantine: Quarantine,
                 tokenizer: Decoder | None, policy: MigrationPolicy, tls: TlsConfig):
        self.relay = relay
        self.instances = instances
        self.quarantine = quarantine
        self.tokenizer = tokenizer
        self.policy = policy
        self.tls = tls
        self.counters = MigrationCounters()

    async def run(self, req: PreparedRequest, handle: Inflight, arrival: float,
                  deadline: float) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """Relay.run, resumed elsewhere after each retryable failure."""
        async with aclosing(self._run(Delivery(req, arrival, self.tokenizer), handle,
                                      deadline)) as stream:
            async for msg in stream:
                yield msg

    async def _run(self, delivery: Delivery, handle: Inflight, deadline: float,
                   ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """The request of `delivery`, from what it has delivered (a continuation when it has
        delivered tokens), as the client's messages."""
        req, arrival = delivery.req, delivery.arrival
        attempt = delivery.continuation()
        failures = 0
        while True:
            try:
                async with aclosing(self.relay.run(attempt, handle, arrival, deadline)) as stream:
                    async for msg in stream:
                        yield delivery.pass_on(msg)
                        if delivery.finished:
                            return
                return
            except (grpc.aio.AioRpcError, SplitserveError, redis.RedisError) as exc:
                if handle.aborted or not _retryable(exc):
                    raise
                failures += 1
                failed, why = handle.current, _describe(exc)
                log.warning("request %s: %s failed after %d tokens (%s); failure %d of %d "
                            "allowed", req.request_id, failed.instance_id if failed else "routing",
                            len(delivery.token_ids), why, failures,
                            self.policy.max_retries)
                if failed is not None:
                    await self._probe(failed)
                if failures > self.policy.max_retries:
                    self.counters.gave_up += 1
                    raise _unavailable(exc, f"giving up after {failures} failed attempts") from exc
                if not await self._wait_for_instances(delivery, handle, deadline):
                    self.counters.gave_up += 1
                    raise _unavailable(exc, "no instance is left to resume the request") from exc
            what = {"splitserve.failed_instance": failed.instance_id if failed else "",
                    "splitserve.tokens_sent": len(delivery.token_ids),
                    "splitserve.error": why}
            if delivery.token_ids:
                self.counters.migrations += 1
                delivery.start_migration()
                handle.span.add_event("migration", what)
                if req.params.n > 1:
                    async with aclosing(self._run_choices(delivery, handle, deadline)) as rest:
                        async for msg in rest:
                            yield msg
                    return
            else:
                self.counters.retries += 1
                handle.span.add_event("retry", what)
            attempt = delivery.continuation()
            handle.internal_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
            handle.prefill = handle.decode = handle.current = None

    async def _run_choices(self, delivery: Delivery, handle: Inflight, deadline: float,
                           ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """n > 1 after a migration: every unfinished choice as a request of its own (each
        migrated again on a later failure), their messages interleaved as they come, under
        their choice's index; usage and timings only on the stream's last message."""
        queue: asyncio.Queue = asyncio.Queue()
        resumed: list[Delivery] = []

        async def pump(index: int, one: Delivery, child: Inflight) -> None:
            try:
                async with aclosing(self._run(one, child, deadline)) as stream:
                    async for msg in stream:
                        await queue.put((index, msg))
                await queue.put((index, None))
            except Exception as exc:  # noqa: BLE001 - passed on to the caller's stream
                await queue.put((index, exc))

        tasks = []
        for index, done in enumerate(delivery.choice_done):
            if done:
                continue
            one = delivery.choice_delivery(index)
            child = Inflight(handle.request_id, f"{handle.request_id}-{uuid.uuid4().hex[:8]}",
                             span=handle.span)
            handle.children.append(child)
            resumed.append(one)
            tasks.append(asyncio.create_task(pump(index, one, child)))
        try:
            running = len(tasks)
            while running:
                index, msg = await queue.get()
                if isinstance(msg, Exception):
                    raise msg
                if msg is None:
                    running -= 1
                    continue
                msg.index = index
                last = bool(msg.finish_reason) and delivery.unfinished == 1
                if not last:
                    msg.ClearField("usage")
                    msg.ClearField("timings")
                else:  # further migrations of single choices count too
                    delivery.migrations += sum(one.migrations - 1 for one in resumed)
                yield delivery.pass_on(msg)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _probe(self, info: InstanceInfo) -> None:
        """Quarantine the instance unless it answers a health check with SERVING."""
        try:
            async with aio_channel(info.address, self.tls) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        log.warning("%s %s does not answer; quarantined for %.1f s", info.kind, info.instance_id,
                    self.quarantine.duration_s)
        self.quarantine.add(info.instance_id)

    async def _wait_for_instances(self, delivery: Delivery, handle: Inflight,
                                  deadline: float) -> bool:
        """Until a decode instance (and a prefill one, unless the decode side will prefill) is
        registered and not in quarantine; False after retry_wait_s or at the deadline. An
        aborted request stops waiting (the next attempt ends it with an abort message)."""
        kinds = ["decode"]
        if (len(delivery.req.prompt_token_ids) + len(delivery.token_ids)
                > self.relay.config.local_prefill_max_tokens):
            kinds.append("prefill")
        limit = min(deadline, time.monotonic() + self.policy.retry_wait_s)
        pause = BACKOFF_S
        while not handle.aborted:
            with contextlib.suppress(redis.RedisError):  # get() answers with the last lists
                await self.instances.refresh()
            try:
                if all([await self.instances.get(k) for k in kinds]):  # quarantine left out
                    return True
            except redis.RedisError as e:
                log.warning("registry unreachable while waiting for instances: %s", e)
            if time.monotonic() + pause > limit:
                return False
            await asyncio.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
        return True


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, redis.RedisError):
        return True
    if isinstance(exc, SplitserveError):
        return exc.grpc_status == "UNAVAILABLE"
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() is grpc.StatusCode.UNAVAILABLE


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def _unavailable(exc: BaseException, why: str) -> SplitserveError:
    if isinstance(exc, SplitserveError):
        return exc  # already says what is missing ("no decode instance is registered")
    if isinstance(exc, redis.RedisError):
        return UnavailableError(f"the block registry is unreachable ({exc}); {why}")
    return UnavailableError(f"{_describe(exc)}; {why}")

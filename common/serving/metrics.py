"""Prometheus metrics of every service (prometheus-client; imports no torch).

Names are the ones vLLM users know, prefixed `splitserve_` (Prometheus keeps colons for recording
rules). Each service builds its metrics object on its own CollectorRegistry, never the process's
default one, so several services in one process (tests) do not clash; each serves its registry
on its own --metrics-port. Every series carries a `model_name` label.

    gateway   what clients see: TTFT, inter-token latency, TPOT, e2e latency, requests by finish
              reason and by error, tokens in and out, goodput of stage "request"
    prefill   queue time, TTFT at the prefill service, goodput of stage "prefill" (TTFT SLO),
              handoffs published, leases expired, blocks stranded by expired leases
    decode    inter-token latency, TPOT and e2e latency at the decode service, goodput of stage
              "decode" (TPOT SLO), handoff bytes, seconds and failures
    prefill and decode, read at scrape time from the engine's thread: requests running and
              waiting, KV cache usage, prefix cache queries and hits (tokens), speculative decoding

A request meets its stage's SLO when every objective given (--slo-ttft-ms, --slo-tpot-ms) holds;
`splitserve_goodput_requests_total{slo_met="true"}` over all of a stage is its goodput fraction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import make_wsgi_app, start_wsgi_server

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine, RequestMetrics

log = logging.getLogger("splitserve.metrics")

PREFIX = "splitserve_"
STAGES = ("request", "prefill", "decode")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 60.0, 120.0, 240.0, 480.0, 960.0)
HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives for goodput; 0 means no objective."""
    ttft_s: float = 0.0
    tpot_s: float = 0.0

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """tpot_s None (a single output token) meets any TPOT objective."""
        ttft_ok = not self.ttft_s or (ttft_s is not None and ttft_s <= self.ttft_s)
        tpot_ok = not self.tpot_s or tpot_s is None or tpot_s <= self.tpot_s
        return ttft_ok and tpot_ok


@dataclass(slots=True)
class StreamTimer:
    """When one request's tokens arrived (monotonic seconds)."""
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0

    def add(self, n: int, now: float) -> float | None:
        """n tokens arrived at `now`; the gap since the previous tokens (None for the first)."""
        gap = None if self.last_token is None else now - self.last_token
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.num_tokens += n
        return gap

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (self.num_tokens - 1)


# A readiness report: {"status": "ready" | "not ready", ...}; /health answers 200 for "ready".
HealthReport = Callable[[], dict]


def _with_health(metrics_app: Callable, health: HealthReport) -> Callable:
    """A WSGI app answering /health from `health()` (200 or 503, the report as JSON) and
    everything else from `metrics_app`."""
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO") != "/health":
            return metrics_app(environ, start_response)
        report = health()
        body = json.dumps(report).encode()
        status = "200 OK" if report.get("status") == "ready" else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body)))])
        return [body]

    return app


class MetricsServer:
    """/metrics of one registry over HTTP (and /health, given a report), on a thread of its
    own."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 health: HealthReport | None = None):
        self._server, self._thread = start_wsgi_server(port, host, registry)
        if health is not None:
            self._server.set_app(_with_health(make_wsgi_app(registry), health))

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


class ServiceMetrics:
    """A service's metrics on a registry of its own."""

    def __init__(self, model_name: str, slo: SLO):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.slo = slo
        self._goodput = Counter(
            PREFIX + "goodput_requests", "Finished requests by stage and whether they met the "
            "stage's latency SLOs (--slo-ttft-ms, --slo-tpot-ms)",
            ("model_name", "stage", "slo_met"), registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ("model_name",), buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ("model_name",),
                       registry=self.registry).labels(self.model_name)

    def labelled_counter(self, name: str, doc: str, label: str, values: tuple[str, ...] = (),
                         ) -> Callable[[str], Counter]:
        """A counter with one more label; `values` are exported (at 0) from the start."""
        family = Counter(PREFIX + name, doc, ("model_name", label), registry=self.registry)
        for value in values:
            family.labels(self.model_name, value)
        return lambda value: family.labels(self.model_name, value)

    def count_goodput(self, stage: str, met: bool) -> None:
        self._goodput.labels(self.model_name, stage, "true" if met else "false").inc()

    def init_goodput(self, stage: str) -> None:
        for met in ("true", "false"):
            self._goodput.labels(self.model_name, stage, met)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int, health: HealthReport | None = None) -> MetricsServer:
        return MetricsServer(self.registry, host, port, health)


class GatewayMetrics(ServiceMetrics):
    """Latencies as clients see them, one StreamTimer per request (see observe_* below)."""

    def __init__(self, model_name: str, slo: SLO, num_inflight: Callable[[], int]):
        super().__init__(model_name, slo)
        Gauge(PREFIX + "num_requests_running", "Requests the gateway is serving",
              ("model_name",), registry=self.registry).labels(model_name).set_function(
                  lambda: float(num_inflight()))
        self.ttft = self.histogram("time_to_first_token_seconds",
                                   "Time to first token, from request arrival", TTFT_BUCKETS)
        self.itl = self.histogram("inter_token_latency_seconds",
                                  "Time between consecutive streamed pieces", ITL_BUCKETS)
        self.tpot = self.histogram("request_time_per_output_token_seconds",
                                   "Mean time per output token after the first", ITL_BUCKETS)
        self.e2e = self.histogram("e2e_request_latency_seconds",
                                  "Request latency, arrival to last token", REQUEST_BUCKETS)
        self.prompt_tokens = self.counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = self.counter("generation_tokens", "Generated tokens")
        self.success = self.labelled_counter(
            "request_success", "Finished requests by finish reason", "finished_reason",
            ("stop", "length", "abort"))
        self.failure = self.labelled_counter(
            "request_failure", "Requests that ended with an error, by status code", "code")
        self.init_goodput("request")

    def observe_tokens(self, timer: StreamTimer, n: int, now: float) -> None:
        if n <= 0:
            return
        gap = timer.add(n, now)
        self.generation_tokens.inc(n)
        if gap is None:
            self.ttft.observe(now - timer.arrival)
        else:
            self.itl.observe(gap)

    def observe_finished(self, timer: StreamTimer, finish_reason: str, prompt_tokens: int,
                         now: float) -> None:
        self.e2e.observe(now - timer.arrival)
        tpot = timer.tpot
        if tpot is not None:
            self.tpot.observe(tpot)
        self.prompt_tokens.inc(prompt_tokens)
        self.success(finish_reason).inc()
        if finish_reason != "abort":
            self.count_goodput("request", self.slo.met(timer.ttft, tpot))

    def observe_failed(self, code: str) -> None:
        self.failure(code).inc()


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    num_drafts: int            # sequence-steps that carried draft tokens
    num_draft_tokens: int      # draft tokens verified
    num_accepted_tokens: int   # of which the target model accepted
    accepted_per_position: tuple[int, ...]  # [j]: how often draft j + 1 was accepted


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one engine, taken on its thread."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float      # fraction of KV blocks referenced
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int     # of which found
    num_held_blocks: int       # blocks pinned for handoffs (prefill side)
    spec_decode: SpecDecodeStats | None = None  # None when speculative decoding is off


def engine_stats(engine: LLMEngine) -> EngineStats:
    """Call on the engine's thread (EngineLoop.call) for a consistent snapshot."""
    bm = engine.block_manager
    spec = None
    if engine.speculator is not None:
        c = engine.spec_counters
        spec = SpecDecodeStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                               tuple(c.accepted_per_position))
    return EngineStats(
        num_running=engine.num_running, num_waiting=engine.num_waiting,
        kv_cache_usage=bm.usage(), prefix_cache_queries=bm.prefix_queries,
        prefix_cache_hits=bm.prefix_hits,
        num_held_blocks=sum(len(table) for table in engine.kv.held.values()), spec_decode=spec)


class _EngineCollector:
    """Engine gauges and counters, read at scrape time; the last snapshot if a read fails."""

    def __init__(self, model_name: str, read: Callable[[], EngineStats]):
        self.model_name = model_name
        self.read = read
        self.last: EngineStats | None = None

    def collect(self):
        try:
            self.last = self.read()
        except Exception:
            log.exception("reading the engine's figures for /metrics failed")
        s = self.last
        if s is None:
            return
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests in the engine's running batch",
                    s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting for the engine", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)",
                    s.kv_cache_usage)
        yield gauge("handoff_held_blocks", "KV blocks pinned for handoffs not yet confirmed",
                    s.num_held_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      s.prefix_cache_hits)
        spec = s.spec_decode
        if spec is None:
            return
        yield counter("spec_decode_num_drafts", "Sequence-steps that verified draft tokens",
                      spec.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified",
                      spec.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted",
                      spec.num_accepted_tokens)
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft", labels=["model_name", "position"])
        for position, count in enumerate(spec.accepted_per_position):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos


class EngineMetrics(ServiceMetrics):
    """What a prefill and a decode service share: the engine's figures, read by `read_stats`
    at scrape time (a callable that snapshots the engine on its thread)."""

    def __init__(self, model_name: str, slo: SLO, read_stats: Callable[[], EngineStats]):
        super().__init__(model_name, slo)
        self.registry.register(_EngineCollector(model_name, read_stats))
        self.queue_time = self.histogram(
            "request_queue_time_seconds", "Time in the engine's waiting queue before the first "
            "forward step", REQUEST_BUCKETS)


class PrefillMetrics(EngineMetrics):
    def __init__(self, model_name: str, slo: SLO, read_stats: Callable[[], EngineStats]):
        super().__init__(model_name, slo, read_stats)
        self.ttft = self.histogram("time_to_first_token_seconds", "Time to first token at the "
                                   "prefill service, from the request's arrival there",
                                   TTFT_BUCKETS)
        self.handoffs = self.counter("handoffs_delivered", "Prompts' KV delivered to a decode "
                                     "service that pulled and verified it")
        self.delivery_failures = self.counter(
            "handoff_delivery_failures", "Deliveries the decode service refused or that failed "
            "(its blocks are released all the same; the decode side recomputes)")
        self.express_starts = self.counter(
            "prefill_express_starts", "Prompts a gateway on this host started through the express "
            "lane, ahead of their Prefill call (common/serving/express.py)")
        self.init_goodput("prefill")

    def observe_prefilled(self, m: RequestMetrics) -> None:
        """A prompt's first token is out (m from its RequestOutput)."""
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        if ttft is not None:
            self.ttft.observe(ttft)
        self.count_goodput("prefill", self.slo.met(ttft, None))


class DecodeMetrics(EngineMetrics):
    def __init__(self, model_name: str, slo: SLO, read_stats: Callable[[], EngineStats]):
        super().__init__(model_name, slo, read_stats)
        self.itl = self.histogram("inter_token_latency_seconds", "Time between consecutive "
                                  "outputs of a request at the decode service", ITL_BUCKETS)
        self.tpot = self.histogram("request_time_per_output_token_seconds", "Mean time per "
                                   "output token after the first, at the decode service",
                                   ITL_BUCKETS)
        self.e2e = self.histogram("e2e_request_latency_seconds", "Time from a request's arrival "
                                  "at the decode service to its last token", REQUEST_BUCKETS)
        self.handoff_bytes = self.labelled_counter(
            "handoff_bytes", "KV bytes pulled from prefill services", "transport")
        self._handoff_seconds = Histogram(
            PREFIX + "handoff_seconds", "Handoff time: pull and verify (the reservation overlaps the prefill)",
            ("model_name", "transport"), buckets=HANDOFF_BUCKETS, registry=self.registry)
        self.handoff_failures = self.labelled_counter(
            "handoff_failures", "Handoffs that could not be used (the prompt was recomputed)",
            "reason", ("peer_gone", "transfer", "lease_expired"))
        self.handoffs_rung = self.counter(
            "handoff_doorbell_rings", "Deliveries whose pull a prefill service on this host "
            "started through the doorbell, ahead of its Deliver call")
        self.express_replies = self.counter(
            "decode_express_replies", "Streams whose first message also went to a gateway on this "
            "host as an express datagram from the engine's thread")
        self.init_goodput("decode")

    def observe_handoff(self, transport: str, num_bytes: int, seconds: float) -> None:
        self.handoff_bytes(transport).inc(num_bytes)
        self._handoff_seconds.labels(self.model_name, transport).observe(seconds)

    def observe_tokens(self, timer: StreamTimer, n: int, now: float) -> None:
        if n <= 0:
            return
        gap = timer.add(n, now)
        if gap is not None:
            self.itl.observe(gap)

    def observe_finished(self, timer: StreamTimer, m: RequestMetrics, now: float) -> None:
        if m.first_scheduled_time is not None and m.first_scheduled_time > m.arrival_time:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.e2e.observe(now - timer.arrival)
        tpot = timer.tpot
        if tpot is not None:
            self.tpot.observe(tpot)
        self.count_goodput("decode", self.slo.met(None, tpot))

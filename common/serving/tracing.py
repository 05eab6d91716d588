"""Tracing with OpenTelemetry: one trace per request across the gateway, prefill and decode.

Off by default, and then free: without `--otlp-endpoint` no tracer provider is installed, every
span is the API's non-recording one (no clock reads, no export) and no trace context is sent.
With an endpoint each process exports its spans over OTLP/gRPC in batches, named by
`service.name` (`splitserve-gateway`, `-prefill`, `-decode`) and `service.instance.id`.

The W3C trace context (`traceparent`, `tracestate`) travels in gRPC metadata: from the client's
call into the gateway (a client without one gets a trace started there), from the gateway into
the Prefill and Decode calls, and from the prefill service into DecodeService.Deliver. Spans are
passed as explicit contexts, never through the current-context variable: the services stream
from async generators, whose context would leak into their consumer at every yield.

A request's trace (parent -> child):

    gateway.request                       the whole request as the client sees it
      gateway.route                       choosing the decode and prefill instances
      prefill                             the Prefill call on the prefill service
        prefill.queue, prefill.compute    in the engine's queue; its forward steps
        handoff.deliver                   checksum and the Deliver call (bytes, blocks)
          handoff.pull                    the decode side's pull and verify (transport, GB/s)
      decode                              the Decode call on the decode service
        decode.reserve                    reserving blocks for the delivered KV
        decode.wait_kv                    until the delivery is pulled (or recomputed)
        decode.generate                   in the batch until the last token

Migrations and retries are events on gateway.request. Stages measured before their span could
be opened (an engine's queue and compute) are recorded afterwards with their own start and end
times.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = Context()
_enabled = False
NO_SPAN: Span = trace.INVALID_SPAN
# The batch exporter's period: short, so a trace is complete a moment after its request ends.
EXPORT_DELAY_MS = 500


def configure(service: str, endpoint: str, instance_id: str = "") -> None:
    """Export this process's spans to the OTLP/gRPC `endpoint` (host:port); "" leaves tracing
    off. Imports the SDK only when tracing is on."""
    global _enabled
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": f"splitserve-{service}"}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, insecure=True),
        schedule_delay_millis=EXPORT_DELAY_MS))
    trace.set_tracer_provider(provider)
    _enabled = True


def shutdown() -> None:
    """Export what is left (at a service's exit)."""
    provider = trace.get_tracer_provider()
    if _enabled and hasattr(provider, "shutdown"):
        provider.shutdown()


def enabled() -> bool:
    return _enabled


def context_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from gRPC invocation metadata (or HTTP headers as pairs); an
    empty context, which makes a new trace, when there is none."""
    if not _enabled or metadata is None:
        return _ROOT
    carrier = {k.lower(): v for k, v in metadata if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def metadata_for(span: Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes the callee's spans children of `span` (none when off)."""
    if not _enabled or not span.get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def start(name: str, parent: Context | Span | None, *, kind: SpanKind = SpanKind.INTERNAL,
          attributes: Mapping[str, object] | None = None, start_ns: int | None = None) -> Span:
    """A span under `parent` (a context, or a span; None: a new trace); end it with
    span.end()."""
    if not _enabled:
        return NO_SPAN
    if parent is None:
        parent = _ROOT
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return trace.get_tracer("splitserve").start_span(
        name, context=context, kind=kind, attributes=attributes, start_time=start_ns)


def record(name: str, parent: Span, start_mono: float, end_mono: float,
           attributes: Mapping[str, object] | None = None) -> None:
    """A span already over, between two time.monotonic() readings."""
    if not _enabled or not parent.get_span_context().is_valid:
        return
    start(name, parent, attributes=attributes, start_ns=wall_ns(start_mono)).end(
        end_time=wall_ns(end_mono))


def finished(span: Span, usage: object, finish_reason: int) -> None:
    """The request's totals on its span (usage: a types_pb2.Usage)."""
    if span.is_recording():
        span.set_attributes({"splitserve.completion_tokens": usage.completion_tokens,
                             "splitserve.cached_tokens": usage.num_cached_tokens,
                             "splitserve.finish_reason": finish_reason})


def failed(span: Span, description: str) -> None:
    span.set_status(Status(StatusCode.ERROR, description))


def wall_ns(mono: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds, as spans carry time."""
    return time.time_ns() - int((time.monotonic() - mono) * 1e9)

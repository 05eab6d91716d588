"""Tracing off (no --otlp-endpoint, the default) is free: no SDK imported, every span the API's
non-recording one, no trace context read from callers or sent on. Tracing on is tested through
the real stack (tests/stack/test_tracing.py)."""

from __future__ import annotations

import subprocess
import sys

from common.serving import tracing


def test_off_by_default_hands_out_the_no_op_span():
    assert not tracing.enabled()
    span = tracing.start("gateway.request", None, attributes={"a": 1})
    assert span is tracing.NO_SPAN and not span.is_recording()
    assert tracing.metadata_for(span) == ()
    incoming = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    child = tracing.start("prefill", tracing.context_from(incoming))
    assert child is tracing.NO_SPAN
    tracing.record("prefill.queue", span, 0.0, 1.0)  # nothing to record, nothing raised
    tracing.failed(span, "x")
    span.end()


def test_configure_without_an_endpoint_imports_no_sdk():
    code = ("import sys; from common.serving import tracing; tracing.configure('gateway', ''); "
            "print(any(m.startswith('opentelemetry.sdk') or 'exporter' in m "
            "for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

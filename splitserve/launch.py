"""The command lines of the stack's services, and starting them as child processes.

One source for every place that runs the services: `splitserve up`, docker-compose.yml (a test
checks its commands against these) and the stack tests.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence

ROLES = ("gateway", "prefill", "decode")


def service_argv(role: str, *, registry_url: str, namespace: str = "splitserve",
                 host: str = "127.0.0.1", port: int = 0, model: str = "SmolLM2-135M-Instruct",
                 metrics_port: int = 0, http_port: int = 0, extra: Sequence[str] = (),
                 ) -> list[str]:
    """`splitserve <role> ...`: the flags every deployment sets, then `extra` (engine flags for
    prefill and decode, e.g. --num-kv-blocks). metrics_port and (gateway only) http_port 0 leave
    /metrics and the HTTP API off."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if http_port and role != "gateway":
        raise ValueError("only the gateway serves the HTTP API")
    port_flag = "--grpc-port" if role == "gateway" else "--port"
    argv = ["splitserve", role, "--host", host, port_flag, str(port), "--registry-url",
            registry_url, "--registry-namespace", namespace, "--model", model]
    if metrics_port:
        argv += ["--metrics-port", str(metrics_port)]
    if http_port:
        argv += ["--http-port", str(http_port)]
    return [*argv, *extra]


def python_argv(argv: Sequence[str]) -> list[str]:
    """The same command through this interpreter (`python -m splitserve.cli ...`), which works
    without the console script on PATH."""
    if not argv or argv[0] != "splitserve":
        raise ValueError(f"not a splitserve command line: {argv}")
    return [sys.executable, "-m", "splitserve.cli", *argv[1:]]


def start_service(argv: Sequence[str], **popen: object) -> subprocess.Popen:
    """Start `splitserve ...` (argv from service_argv) as a child process. (No preexec_fn: the
    callers have threads, and code run between fork and exec can deadlock on their locks.)"""
    return subprocess.Popen(python_argv(argv), stdin=subprocess.DEVNULL, **popen)  # type: ignore[arg-type]


def stop_services(procs: Sequence[subprocess.Popen], timeout_s: float = 15.0) -> list[int]:
    """SIGTERM each (graceful shutdown), wait, SIGKILL what is left; the exit codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes

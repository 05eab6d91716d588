"""The command lines of the stack's services, starting them as child processes, and keeping
them running (Supervisor, RestartPolicy: `splitserve up`).

One source for every place that runs the services: `splitserve up`, docker-compose.yml (a test
checks its commands against these) and the stack tests.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised service that exited is started again (`splitserve up --on-service-exit
    restart`, like compose's `restart: unless-stopped`).

    Each service (slot) counts its own exits over the last `window_s` seconds. Its n-th exit in
    that window is restart n, started after backoff_s * 2**(n-1) seconds, at most max_backoff_s
    (1, 2, 4, ... with the defaults); exit max_restarts + 1 within the window is a crash loop, and
    the supervisor gives up. A service that stays up for window_s starts again from backoff_s.
    """

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 <= backoff_s <= max_backoff_s")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("need max_restarts >= 0 and window_s > 0")


class RestartBudget:
    """RestartPolicy's accounting, pure (the clock is an argument)."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self._exits: dict[str, deque[float]] = {}

    def on_exit(self, name: str, now: float) -> tuple[int, float] | None:
        """`name` exited at `now`: (restart number, seconds to wait before it), or None when
        that is one exit too many within the window (a crash loop)."""
        exits = self._exits.setdefault(name, deque())
        exits.append(now)
        while exits and exits[0] <= now - self.policy.window_s:
            exits.popleft()
        n = len(exits)
        if n > self.policy.max_restarts:
            return None
        return n, min(self.policy.backoff_s * 2 ** (n - 1), self.policy.max_backoff_s)


@dataclass
class _Child:
    argv: list[str]
    proc: subprocess.Popen
    restart_at: float | None = None  # set while it waits out its backoff
    restarts: int = 0


class Supervisor:
    """The stack's services as named child processes (`prefill-0`, `decode-1`, `gateway`),
    checked by poll().

    With a RestartPolicy, a service that exited is logged (one `service exited: ...` line on
    stderr: role, name, pid, exit code or signal, restart number) and started again with the same
    argv after its backoff; the others keep serving. Its instance id is <kind>-<host>-<pid>
    unless argv sets one, so a restarted service registers anew, and its old entry expires with
    its heartbeat. poll() returns why the stack must stop: a crash loop, or (policy None) the
    first exit. stop() ends every child, and starts none after it.
    """

    def __init__(self, policy: RestartPolicy | None, *,
                 start: Callable[[Sequence[str]], subprocess.Popen] = start_service,
                 clock: Callable[[], float] = time.monotonic):
        self.budget = None if policy is None else RestartBudget(policy)
        self._start, self._clock = start, clock
        self._children: dict[str, _Child] = {}
        self._stopped = False

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
        proc = self._start(argv)
        self._children[name] = _Child(list(argv), proc)
        return proc

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The current process of each service, in start order."""
        return [c.proc for c in self._children.values()]

    def poll(self) -> str | None:
        if self._stopped:
            return None
        now = self._clock()
        for name, child in self._children.items():
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.proc, child.restart_at = self._start(child.argv), None
                    print(f"service restarted: name={name} pid={child.proc.pid} "
                          f"restart={child.restarts}", file=sys.stderr, flush=True)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            if self.budget is None:
                return f"{name} (pid {child.proc.pid}) exited with {exit_status(code)}"
            verdict = self.budget.on_exit(name, now)
            restart = "none" if verdict is None else f"{verdict[0]} in_s={verdict[1]:g}"
            print(f"service exited: role={name.split('-')[0]} name={name} pid={child.proc.pid} "
                  f"exit={exit_status(code)} restart={restart}", file=sys.stderr, flush=True)
            if verdict is None:
                policy = self.budget.policy
                return (f"{name} is crash-looping: {policy.max_restarts + 1} exits within "
                        f"{policy.window_s:g} s (--max-restarts {policy.max_restarts})")
            child.restarts, child.restart_at = verdict[0], now + verdict[1]
        return None

    def stop(self, timeout_s: float = 15.0) -> list[int]:
        """End every child (stop_services), waiting ones included; none is restarted after."""
        self._stopped = True
        return stop_services([c.proc for c in self._children.values()], timeout_s)


def exit_status(code: int) -> str:
    """A Popen returncode as a person reads it: "0", "1", "SIGKILL"."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)

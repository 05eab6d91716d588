"""Where a process runs, to choose a KV transport: same process, same host, or elsewhere."""

from __future__ import annotations

import functools
import os
import socket
import uuid
from pathlib import Path


@functools.cache
def host_id() -> str:
    """Identifies this machine (and container): /etc/machine-id plus the hostname.

    Both parts, because containers built from one image can share a machine id across hosts while
    their hostnames differ; two processes with equal host ids can reach each other's /dev/shm and
    GPUs. Services can override it with a config value where that rule does not hold.
    """
    machine_id = Path("/etc/machine-id")
    machine = machine_id.read_text().strip() if machine_id.is_file() else ""
    return f"{machine}/{socket.gethostname()}"


_process: tuple[int, str] | None = None


def process_id() -> str:
    """Identifies this process; recomputed in a forked child, which must not pass for its parent."""
    global _process
    pid = os.getpid()
    if _process is None or _process[0] != pid:
        _process = (pid, f"{host_id()}/{pid}/{uuid.uuid4().hex[:12]}")
    return _process[1]

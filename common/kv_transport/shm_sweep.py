"""Removing the shared-memory KV pools that killed prefill services left behind.

A SharedMemoryPool file (common/kv_transport/shm.py) is named <prefix>-<pid>-<random>.kv and
removed at a clean exit; a service killed with SIGKILL (or by the OOM killer) cannot remove it,
and the file keeps its whole pool's worth of RAM until someone does. A prefill service sweeps
the directory at start-up: it removes the files of this user whose pid no longer runs. A file
whose pid was reused by another process is left alone (the safe side). No torch.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("splitserve.shm")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_pools(directory: str | os.PathLike = "/dev/shm",
                      prefix: str = "splitserve-kv") -> list[Path]:
    """Remove this user's pool files whose process is gone; the paths removed."""
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+\.kv")
    removed = []
    for path in Path(directory).glob(f"{prefix}-*.kv"):
        match = pattern.fullmatch(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            path.unlink()
        except FileNotFoundError:  # another service swept it first
            continue
        removed.append(path)
        log.warning("removed %s, the KV pool of dead process %s", path, match.group(1))
    return removed

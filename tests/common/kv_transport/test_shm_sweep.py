"""sweep_stale_pools: files of dead processes go, files of live ones and strangers stay."""

from __future__ import annotations

import os
import subprocess
import sys

from common.kv_transport.shm_sweep import sweep_stale_pools


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_removes_only_pools_of_dead_processes(tmp_path):
    gone = dead_pid()
    names = [f"splitserve-kv-{gone}-0123456789ab.kv",       # dead owner: removed
             f"splitserve-kv-{os.getpid()}-abcdef012345.kv",  # live owner: kept
             f"splitserve-kv-{gone}-notahexname.kv",          # not a pool name: kept
             f"other-{gone}-0123456789ab.kv"]                 # another prefix: kept
    for name in names:
        (tmp_path / name).write_bytes(b"kv")
    removed = sweep_stale_pools(tmp_path)
    assert removed == [tmp_path / names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    assert sweep_stale_pools(tmp_path) == []

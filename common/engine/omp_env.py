"""The OpenMP settings of a CPU engine's process (EngineConfig's model.cpu_omp_spin_count).

GNU OpenMP (torch's, on Linux) reads its environment once, when torch loads it: the setting is
an environment variable set before the first `import torch`, by the splitserve command (which
imports torch only once a command runs) or by a benchmark that starts itself again with it.

Between two ops a thread of the team spins GOMP_SPINCOUNT times before it sleeps. libgomp's
300000 keeps both threads spinning between every op, which is fastest on an idle box but on a
busy one a spinning thread holds a core that the other thread (or another process) needs, and
every op's region then waits a time slice: on the 2-core box with another process running, a
decode step at batch 32 took 0.4-1.6 s with 300000 and 0.2 s with 1000. On an idle box a short
spin loses instead (threads asleep between ops wait to be woken): the ShareGPT-like bf16 run of
bench/cpu_throughput.py took 32.4 s with 1000 and 21.2 s with 300000, so the default is
libgomp's own (-1).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

VARIABLE = "GOMP_SPINCOUNT"


def wanted_env(spin_count: int) -> dict[str, str]:
    """The environment variables that spin_count asks for (none for -1: libgomp's default)."""
    return {} if spin_count < 0 else {VARIABLE: str(spin_count)}


def set_spin_count(spin_count: int) -> bool:
    """Sets the variable for this process if torch is not loaded yet; True if the process runs
    with it (now or already), else warns that it takes effect only at the next start."""
    want = wanted_env(spin_count)
    if all(os.environ.get(k) == v for k, v in want.items()):
        return True
    if "torch" in sys.modules:
        log.warning("cpu_omp_spin_count %d not applied: torch is already loaded (set %s before "
                    "the process starts)", spin_count, VARIABLE)
        return False
    os.environ.update(want)
    return True


def restart_with_spin_count(spin_count: int) -> None:
    """For a script that imports torch at the top: starts the script again (same argv) with the
    variable set, unless it already is. Does not return if it restarts."""
    want = wanted_env(spin_count)
    if any(os.environ.get(k) != v for k, v in want.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **want})

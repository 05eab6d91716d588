"""Builds and loads our CPU C++ kernels (torch.utils.cpp_extension) so that a process killed while
compiling never hangs the next one.

cpp_extension serialises builds of one extension with a lock file in its build directory (a
"baton"): a process that finds it waits, with no timeout, until the file is gone. A process
killed mid-build (Ctrl-C during the first `make up`, a test teardown, the OOM killer) leaves the
file behind, and every later service then hangs on its first decode step. load() takes an
flock on a file of its own beside the build first, which the kernel drops when its holder dies:
whoever holds it is the only splitserve process building that extension, so a baton found then
is stale and is removed before cpp_extension looks.

The build directory: $TORCH_EXTENSIONS_DIR/<name>, else ~/.cache/splitserve/torch_extensions/
<name>; names carry the CPU's flags and torch's version (cpu_tag()), so a build is never loaded
on a CPU it was not made for.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
from pathlib import Path

import torch


def cpu_tag() -> str:
    """Ten hex digits of the CPU's flags and torch's version."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(f"{flags} {torch.__version__}".encode()).hexdigest()[:10]


@functools.cache
def vector_move_flags() -> list[str]:
    """Compiler flags that let GCC copy our 16-lane (64-byte) vector values in 256-bit moves on
    an x86 CPU without AVX-512, where the compiler accepts them (GCC 12 and later); else none.

    Without them GCC's Zen tuning copies each such value (passed by value, selected, spilled)
    with `rep movsl`: on the twelfth session's Zen 3 box perf put most of the extend attention's
    time on those copies, and with the flags the same source ran a 16 x 128-token prefill
    layer in 27.4 ms against 66.9 and a decode layer (batch 32, 160 positions) in 1.29 against
    1.85, its outputs bit for bit the same. An AVX-512 CPU moves 64 bytes in one register and
    keeps its own tuning."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "").split()
    except OSError:
        return []
    if "avx2" not in flags or "avx512f" in flags:
        return []
    wanted = ["-mmove-max=256", "-mstore-max=256"]
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, *wanted, "-x", "c++", "-fsyntax-only", "-"], input=b"",
                              capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return wanted if done.returncode == 0 else []


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "splitserve" / "torch_extensions"
    return base / name


def load(name: str, source: Path, cflags: list[str]) -> None:
    """Compile `source` (if its build is missing or stale) and load it as a library of torch
    ops; raises what the compiler or the loader raise. cflags: extra compiler flags (OpenMP is
    linked)."""
    from torch.utils import cpp_extension

    build = build_directory(name)
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "splitserve.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (build / "lock").unlink(missing_ok=True)  # cpp_extension's baton: stale while we hold
        cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags,
                           extra_ldflags=["-fopenmp"], build_directory=str(build),
                           is_python_module=False, verbose=False)

"""kernels.cpu_build: a build left half-done by a killed process (cpp_extension's lock file still
in the build directory) does not hang the next load, and two processes loading at once both get
the library. A one-op C++ source, compiled for real (about 10-20 s each on the 2-core box)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None,
                                reason="needs g++ and ninja")

SOURCE = """
#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(splitserve_build_test, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
"""

LOADER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from kernels.cpu_build import load
    load("splitserve_build_test", Path(sys.argv[1]), ["-O1"])
    print(torch.ops.splitserve_build_test.twice(torch.ones(2)).tolist())
""")


def run_loaders(tmp_path, n: int) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", LOADER, str(tmp_path / "op.cpp")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_a_stale_lock_does_not_hang_and_concurrent_loads_both_succeed(tmp_path):
    (tmp_path / "op.cpp").write_text(SOURCE)
    build = tmp_path / "ext" / "splitserve_build_test"
    build.mkdir(parents=True)
    (build / "lock").touch()  # what a process killed mid-build leaves
    for result in run_loaders(tmp_path, 2):
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "[2.0, 2.0]"
    assert not (build / "lock").exists()
    (build / "lock").touch()  # built: a stale lock is removed, nothing is compiled again
    [again] = run_loaders(tmp_path, 1)
    assert again.returncode == 0 and again.stdout.strip() == "[2.0, 2.0]", again.stderr[-2000:]

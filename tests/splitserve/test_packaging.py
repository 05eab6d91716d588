"""What `pip install .` installs: the wheel's packages and its dependencies, and that the servers
and the CLI start without the `bench` extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRA = {"httpx2", "matplotlib"}  # the `bench` extra


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel, built from a copy of the tree (a build leaves build/ and *.egg-info behind)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True, timeout=120)
    (path,) = (tmp / "dist").glob("splitserve-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_wheel_holds_the_load_generator_and_no_bench_package(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist() if not name.startswith("splitserve-")}
    assert "bench" not in tops
    assert {"splitserve", "common", "gateway", "prefill_service", "decode_service"} <= tops
    names = set(wheel.namelist())
    assert {f"splitserve/loadgen/{m}.py" for m in
            ("__init__", "backends", "datasets", "hf", "report", "runner")} <= names


def test_wheel_needs_httpx2_and_matplotlib_only_for_the_bench_extra(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = Parser().parsestr(wheel.read(meta).decode())
    assert "bench" in message.get_all("Provides-Extra")
    requires = message.get_all("Requires-Dist")
    by_name: dict[str, list[str]] = {}
    for req in requires:
        name = req.split(";")[0].split("=")[0].strip().lower()
        by_name.setdefault(name, []).append(req)
    for name in EXTRA:
        (req,) = by_name[name]
        assert req.split(";", 1)[1].strip() == 'extra == "bench"', req
    bench_only = {name for name, reqs in by_name.items()
                  if all('extra == "bench"' in r for r in reqs)}
    assert bench_only == EXTRA


def test_servers_and_cli_start_without_the_extra():
    """With httpx2 and matplotlib unimportable, from outside the repository: `--help` of the
    commands works (`gateway` still without torch), the three servers import, `bench` is gone."""
    code = (
        "import contextlib, io, sys\n"
        f"for m in {sorted(EXTRA)!r}: sys.modules[m] = None\n"
        "from splitserve.cli import main\n"
        "def help_of(cmd):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([cmd, '--help'])\n"
        "    print(cmd, 'torch' in sys.modules)\n"
        "for cmd in ('gateway', 'bench', 'up'):\n"
        "    help_of(cmd)\n"
        "import gateway.server, prefill_service.server, decode_service.server\n"
        "import importlib.util\n"
        "print('bench', importlib.util.find_spec('bench'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["gateway False", "bench False"]
    assert lines[2].startswith("up ") and lines[3:] == ["bench None"]

"""The house's boundaries, enforced: which rooms import without torch, and who may import whom.

docs/ARCHITECTURE.md draws the map; ../shared/STYLE.md states the rules. Torch-free rooms are
checked by importing every module of them in a fresh interpreter; the import rules by reading
each module's import statements (no import runs).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Rooms that must import without torch (the gateway starts in about a second on any machine).
TORCH_FREE = ["common/engine/core", "common/engine/step_input.py", "common/engine/config.py",
              "common/text", "common/serving", "common/registry",
              "common/flags.py", "common/errors.py", "common/kv_transport/locality.py",
              "common/kv_transport/shm_sweep.py", "gateway", "splitserve/cli.py",
              "splitserve/commands/gateway.py", "splitserve/commands/generate.py"]
STDLIB = set(sys.stdlib_module_names)


def modules_of(rel: str) -> list[str]:
    path = ROOT / rel
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    names = []
    for f in files:
        parts = f.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imports_of(path: Path) -> set[str]:
    """Top-level-qualified names a module imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def source_files(*rooms: str) -> list[Path]:
    return [f for room in rooms for f in sorted((ROOT / room).rglob("*.py"))
            if "_pb2" not in f.name]


@pytest.mark.parametrize("room", TORCH_FREE)
def test_room_imports_without_torch(room: str) -> None:
    mods = modules_of(room)
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "bad = {'torch', 'transformers', 'triton'} & set(sys.modules)\n"
            "assert not bad, f'imported {bad}'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_services_never_import_each_other() -> None:
    for a, b in (("prefill_service", "decode_service"), ("decode_service", "prefill_service")):
        for f in source_files(a):
            bad = {m for m in imports_of(f) if m == b or m.startswith(b + ".")}
            assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_common_imports_no_service() -> None:
    services = ("prefill_service", "decode_service", "gateway", "splitserve")
    for f in source_files("common"):
        bad = {m for m in imports_of(f) if m.split(".")[0] in services}
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_kernels_import_only_torch_and_triton() -> None:
    allowed = STDLIB | {"torch", "triton", "kernels", "__future__"}
    for f in source_files("kernels"):
        bad = {m for m in imports_of(f) if m.split(".")[0] not in allowed}
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_gateway_imports_no_engine_mechanism() -> None:
    """The gateway may read engine policy and config (pure Python), never the model side."""
    engine_side = ("common.engine.engine", "common.engine.model_runner", "common.engine.cuda_runner",
                   "common.engine.sampler", "common.engine.uploads", "common.models",
                   "common.spec_decode", "kernels", "torch")
    for f in source_files("gateway"):
        bad = {m for m in imports_of(f) if m.startswith(engine_side)}
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_the_rule_readers_see_real_imports() -> None:
    """The AST reader finds what a module really imports (so the rules above test something)."""
    found = imports_of(ROOT / "common" / "engine" / "engine.py")
    assert "torch" in found and "common.engine.core.scheduler" in found

"""The protos by buf's rules (protos/buf.yaml): `buf lint` clean, and `buf breaking` finds no
change that breaks generated code or the wire against the previous commit's protos (and against
HEAD's, for changes not committed yet). A breaking change has to go into a new package version
(splitserve/v2/) beside the old one. buf comes from npm (@bufbuild/buf, installed by `make
install` into tests/clients/node)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
BUF = ROOT / "tests" / "clients" / "node" / "node_modules" / ".bin" / "buf"


@pytest.fixture(scope="module")
def buf() -> str:
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed (buf is installed from npm)")
    assert BUF.exists(), "buf is missing: run `make install` (npm ci in tests/clients/node)"
    return str(BUF)


def protos_at(ref: str, dest: Path) -> Path | None:
    """protos/ (the .proto files and buf.yaml) as of `ref`, or None when `ref` does not exist
    or its protos predate buf's layout (no protos/buf.yaml)."""
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "protos"], cwd=ROOT,
                             capture_output=True)
    if archive.returncode != 0:
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.endswith(".proto") or m.name == "protos/buf.yaml"]
        tar.extractall(dest, members=members, filter="data")
    module = dest / "protos"
    return module if (module / "buf.yaml").exists() else None


def test_lint_is_clean(buf):
    done = subprocess.run([buf, "lint"], cwd=PROTOS, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_lint_catches_a_violation(buf, tmp_path):
    """The check can fail: a service without the Service suffix is reported."""
    shutil.copytree(PROTOS, tmp_path / "protos", ignore=shutil.ignore_patterns("*.py*"))
    gen = tmp_path / "protos" / "splitserve" / "v1" / "generation.proto"
    gen.write_text(gen.read_text().replace("service GenerationService {", "service Generation {"))
    done = subprocess.run([buf, "lint"], cwd=tmp_path / "protos", capture_output=True, text=True)
    assert done.returncode != 0
    assert 'Service name "Generation" should be suffixed with "Service"' in done.stdout


@pytest.mark.parametrize("ref", ["HEAD", "HEAD~1"])
def test_no_breaking_change(buf, tmp_path, ref):
    against = protos_at(ref, tmp_path)
    if against is None:
        pytest.skip(f"{ref} has no protos under buf's layout to compare with")
    done = subprocess.run([buf, "breaking", "--against", str(against)], cwd=PROTOS,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"breaking changes against {ref}:\n{done.stdout}{done.stderr}"


def test_breaking_catches_a_renumbered_field(buf, tmp_path):
    """The check can fail: moving a field to another number is reported."""
    shutil.copytree(PROTOS, tmp_path / "protos", ignore=shutil.ignore_patterns("*.py*"))
    types = tmp_path / "protos" / "splitserve" / "v1" / "types.proto"
    text = types.read_text()
    assert "  string request_id = 1;\n}" in text
    types.write_text(text.replace("  string request_id = 1;\n}", "  string request_id = 99;\n}", 1))
    done = subprocess.run([buf, "breaking", "--against", str(PROTOS)], cwd=tmp_path / "protos",
                          capture_output=True, text=True)
    assert done.returncode != 0 and "request_id" in done.stdout, done.stdout

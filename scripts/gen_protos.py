"""Generate the Python modules of every protos/**/*.proto (run from anywhere; writes beside them).

Imports in generated code are rooted at the repository (`from protos.splitserve.v1 import x_pb2`),
so protoc runs from the repository root with `-I.`. The outputs are git-ignored.
"""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def proto_files(root: Path = ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "protos").rglob("*.proto"))


def main() -> int:
    files = proto_files()
    if not files:
        print("no .proto files under protos/", file=sys.stderr)
        return 1
    well_known = resources.files("grpc_tools") / "_proto"
    argv = ["grpc_tools.protoc", "-I.", f"-I{well_known}", "--python_out=.",
            "--grpc_python_out=.", "--pyi_out=.", *files]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = protoc.main(argv)
    finally:
        os.chdir(cwd)
    if rc != 0:
        print(f"protoc failed ({rc})", file=sys.stderr)
        return rc
    print(f"generated Python for {len(files)} proto files: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

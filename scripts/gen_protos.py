"""Generate the Python modules of every protos/**/*.proto (run from anywhere; writes beside them).

`protos/` is the include root, as for every other language and for buf: the files import
`splitserve/v1/...`. Python imports the generated modules as the package `protos.splitserve.v1`
(a top-level `splitserve` is the CLI), so the generated imports are rewritten to that root. The
outputs are git-ignored.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


PROTOS = ROOT / "protos"


def proto_files(root: Path = PROTOS) -> list[str]:
    """The .proto files, relative to the include root."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.proto"))


def root_imports(root: Path = PROTOS) -> None:
    """`from splitserve.v1 import x_pb2` -> `from protos.splitserve.v1 import x_pb2`."""
    for path in root.rglob("*_pb2*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^(from|import) splitserve\.", r"\1 protos.splitserve.", text,
                       flags=re.MULTILINE)
        if fixed != text:
            path.write_text(fixed)


def main() -> int:
    files = proto_files()
    if not files:
        print("no .proto files under protos/", file=sys.stderr)
        return 1
    well_known = resources.files("grpc_tools") / "_proto"
    argv = ["grpc_tools.protoc", "-I.", f"-I{well_known}", "--python_out=.",
            "--grpc_python_out=.", "--pyi_out=.", *files]
    cwd = os.getcwd()
    os.chdir(PROTOS)
    try:
        rc = protoc.main(argv)
    finally:
        os.chdir(cwd)
    if rc != 0:
        print(f"protoc failed ({rc})", file=sys.stderr)
        return rc
    root_imports()
    print(f"generated Python for {len(files)} proto files: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

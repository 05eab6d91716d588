"""`splitserve bench` itself: registration, argument parsing, the workload it builds, and the
one-line error when the `bench` extra is missing. (The load generator's own tests are under
tests/splitserve/loadgen/; the gRPC and HTTP backends run against a live stack in
tests/stack/test_observability.py.)"""

from __future__ import annotations

import argparse
import sys

import pytest

from splitserve.cli import COMMANDS, main
from splitserve.commands import bench


def test_cli_registration_and_backend_parsing():
    assert "bench" in COMMANDS
    assert bench.backends_of(None) == ["grpc"]
    assert bench.backends_of(["grpc,hf", "http", "hf"]) == ["grpc", "hf", "http"]
    with pytest.raises(ValueError, match="unknown backend"):
        bench.backends_of(["vllm"])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--dataset", "shared-prefix", "--num-prompts", "3",
                              "--shared-len", "32", "--input-len", "8", "--vocab-size", "500"])
    work = bench.build_workload(args)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in work] == [(40, 64)] * 3


@pytest.mark.parametrize("missing", bench.EXTRA_MODULES)
def test_without_the_extra_bench_says_what_to_install(missing, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, missing, None)  # what `import` sees when it is absent
    assert bench.missing_extra() == [missing]
    assert main(["bench", "--num-prompts", "1", "--no-progress"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (f"splitserve bench needs the bench extra ({missing} not installed): "
                       "pip install 'splitserve[bench]'\n")

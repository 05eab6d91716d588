"""Prefill and decode services, and `up`, refuse a tensor parallel size above 1 at start-up with
a clear error (the KV handoff carries one rank's KV heads), before they load anything."""

from __future__ import annotations

import argparse
import importlib

import pytest


@pytest.mark.parametrize("command", ["prefill", "decode", "up"])
def test_services_refuse_tensor_parallelism(command, capsys):
    module = importlib.import_module(f"splitserve.commands.{command}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--model", "dummy:tiny-llama", "--tensor-parallel-size", "2"])
    assert module.run(args) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 2: prefill and decode services run at tensor parallel " \
        "size 1" in err

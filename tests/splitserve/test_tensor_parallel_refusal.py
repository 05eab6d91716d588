"""Prefill and decode services, and `up`, run tensor parallel on CPU ranks only (the handoff
reaches the other ranks' pools through /dev/shm files, common/engine/rank_kv.py): on a GPU they
refuse a size above 1 at start-up with a clear error, before they load anything. On CPU ranks
they serve (tests/stack/test_tensor_parallel_stack.py)."""

from __future__ import annotations

import argparse
import importlib

import pytest

from common.engine.config import EngineConfig
from common.flags import build
from splitserve.commands.service import tensor_parallel_refusal


@pytest.mark.parametrize("command", ["prefill", "decode", "up"])
def test_services_refuse_tensor_parallelism_on_a_gpu(command, capsys):
    module = importlib.import_module(f"splitserve.commands.{command}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--model", "dummy:tiny-llama", "--tensor-parallel-size", "2",
                              "--device", "cuda"])
    assert module.run(args) == 2
    assert capsys.readouterr().err == (
        "--tensor-parallel-size 2 on device 'cuda': prefill and decode services run tensor "
        "parallel on CPU ranks only for now (the handoff reaches the other ranks' pools "
        "through /dev/shm); run-batch serves a model at any size on any device\n")


def test_cpu_ranks_and_size_1_are_not_refused():
    for device, size in (("cpu", 2), ("cpu", 4), ("cuda", 1), ("cuda:1", 1)):
        config = build(EngineConfig, model="dummy:tiny-llama", device=device,
                       tensor_parallel_size=size)
        assert tensor_parallel_refusal(config) is None

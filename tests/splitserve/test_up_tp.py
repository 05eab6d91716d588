"""`splitserve up --tensor-parallel-size 2` (issue 20): the stack starts with TP 2 prefill and
decode services (each one registry record with its size, one rank subprocess each), and a greedy
request through it, whose prompt's KV moves rank to rank, gives the TP 1 engine's tokens."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.registry import EmbeddedRedis, Registry
from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from tests.cluster import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--cpu-threads", "1"]
PROMPT = [5 + (9 * i) % 400 for i in range(40)]


def test_up_serves_at_tensor_parallel_size_2(tmp_path):
    want = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", dtype="float32",
                           num_kv_blocks=256)).generate([PROMPT], SamplingParams(
                               max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    redis = EmbeddedRedis()
    registry = Registry(redis.url, "up-tp")
    grpc_port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--grpc-port", str(grpc_port),
             "--http-port", str(free_port()), "--registry-url", redis.url,
             "--registry-namespace", "up-tp", "--model", MODEL, *ENGINE_FLAGS,
             "--tensor-parallel-size", "2"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        def started() -> bool:
            assert up.poll() is None, log_path.read_text()[-3000:]
            return b"splitserve is up" in log_path.read_bytes()
        wait_until("splitserve is up", started, 180, interval_s=0.1)
        records = [i for kind in ("prefill", "decode") for i in registry.list_instances(kind)]
        assert sorted((i.kind, i.tensor_parallel_size) for i in records) == [
            ("decode", 2), ("prefill", 2)]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            msgs = list(stub.GenerateStream(generation_pb2.GenerateStreamRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=PROMPT),
                params=types_pb2.SamplingParams(max_tokens=16, temperature=0.0,
                                                ignore_eos=True)), timeout=60))
        assert [t for m in msgs for t in m.token_ids] == want.output_token_ids
        assert msgs[-1].timings.prefill_instance.startswith("prefill")  # through P/D
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        code = up.wait(60)
        registry.close()
        redis.stop()
    assert code == 0, log_path.read_text()[-3000:]

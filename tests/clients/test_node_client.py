"""A client in another language: tests/clients/node/client.js (Node.js, @grpc/grpc-js and
@grpc/proto-loader, built at run time from protos/ alone) against `splitserve up`. Its streamed
tokens equal the Python client's, a stream it cancels mid-way leaves every block free on every
instance, and it reads ModelInfo. `make install` installs its packages (npm ci)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from tests.cluster import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODE_DIR = Path(__file__).parent / "node"
MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--cpu-threads", "1"]
PROMPTS = [[5, 6, 7, 8], [3 + (11 * j) % 400 for j in range(70)], [9] * 33]


def node(*args: str) -> list[dict]:
    done = subprocess.run(["node", str(NODE_DIR / "client.js"), *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), \
        "the Node.js client's packages are missing: run `make install` (npm ci in tests/clients/node)"
    port = free_port()
    log_path = tmp_path_factory.mktemp("node-client") / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--grpc-port", str(port),
             "--http-port", "0", "--model", MODEL, *ENGINE_FLAGS],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until("splitserve up", lambda: b"splitserve is up" in log_path.read_bytes()
                   or up.poll() is not None, 120, interval_s=0.2)
        assert up.poll() is None, log_path.read_text()
        yield f"127.0.0.1:{port}"
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, log_path.read_text()[-3000:]


def request_json(ids: list[int], max_tokens: int) -> str:
    return json.dumps({"prompt_token_ids": {"ids": ids}, "params": {
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})


def python_tokens(address: str, ids: list[int], max_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return [t for msg in stub.GenerateStream(generation_pb2.GenerateStreamRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=ids),
            params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                            ignore_eos=True)), timeout=120)
                for t in msg.token_ids]


def test_streamed_tokens_equal_the_python_clients(gateway):
    for ids in PROMPTS:
        messages = node(gateway, "stream", request_json(ids, 24))
        assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
        assert messages[-1]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24}
        assert len({m["request_id"] for m in messages}) == 1
        tokens = [t for m in messages for t in m.get("token_ids", [])]
        assert tokens == python_tokens(gateway, ids, 24)


def test_cancelled_stream_frees_every_block(gateway):
    messages = node(gateway, "stream", request_json(PROMPTS[1], 1500), "--cancel-after", "3")
    assert messages[-1]["cancelled"] and messages[-1]["tokens"] >= 3
    assert "finish_reason" not in messages[-2]  # cut short, not finished

    def all_free():
        (info,) = node(gateway, "info")
        return all(i.get("num_free_blocks") == i["num_kv_blocks"] and not i.get("num_running")
                   for i in info["instances"])
    wait_until("every block free after the cancel", all_free, 30, interval_s=0.2)


def test_model_info(gateway):
    (info,) = node(gateway, "info")
    with grpc.insecure_channel(gateway) as channel:
        want = generation_pb2_grpc.GenerationServiceStub(channel).ModelInfo(
            generation_pb2.ModelInfoRequest(), timeout=10)
    assert info["model"] == want.model == MODEL
    # proto3 JSON leaves out fields at their zero value
    assert tuple(info.get(k, 0) for k in ("max_model_len", "vocab_size", "block_size")) == (
        want.max_model_len, want.vocab_size, want.block_size)
    assert info["num_prefill_instances"] == info["num_decode_instances"] == 1
    assert sorted(i["role"] for i in info["instances"]) == ["decode", "prefill"]


def test_reflection_describes_the_api_without_proto_files(gateway):
    """What grpcurl does (README's clients section): the service, its methods and their
    messages come from the server's reflection, files and imports resolved under protos/'s
    root (splitserve/v1/...), and a request built from them alone is answered."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from google.protobuf.message_factory import GetMessageClass
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(gateway) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "splitserve.v1.GenerationService" in database.get_services()
        pool = DescriptorPool(database)
        service = pool.FindServiceByName("splitserve.v1.GenerationService")
        assert service.file.name == "splitserve/v1/generation.proto"
        assert [d.name for d in service.file.dependencies] == ["splitserve/v1/types.proto"]
        assert {m.name for m in service.methods} == {
            "Generate", "GenerateStream", "Tokenize", "ModelInfo", "Abort"}
        method = service.methods_by_name["Generate"]
        request_cls = GetMessageClass(method.input_type)
        response_cls = GetMessageClass(method.output_type)
        request = request_cls()
        request.prompt_token_ids.ids.extend(PROMPTS[0])
        request.params.max_tokens, request.params.ignore_eos = 5, True
        request.params.temperature = 0.0
        answer = channel.unary_unary(
            "/splitserve.v1.GenerationService/Generate",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString)(request, timeout=60)
    assert list(answer.token_ids) == python_tokens(gateway, PROMPTS[0], 5)

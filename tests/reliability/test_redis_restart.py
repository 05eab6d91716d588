"""Redis restart: the registry server is killed (SIGKILL: every record, lease and prefix set is
lost) and restarted empty while requests stream. The services re-register; every request in
flight finishes (or fails with a clear status) and none hangs; requests after the restart are
served; no block stays referenced."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.cluster import Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512"]
SERVICE_FLAGS = ["--heartbeat-ttl-s", "1.5"]
MAX_TOKENS = 120


def request(i: int) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        request_id=f"r{i}", prompt_token_ids=generation_pb2.TokenIds(ids=[7 + i] * (5 + 9 * i)),
        params=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


def test_redis_restart_under_load(tmp_path):
    cluster = Cluster(tmp_path, MODEL, engine_flags=ENGINE_FLAGS,
                      prefill_flags=[*SERVICE_FLAGS, "--handoff-lease-s", "3"],
                      decode_flags=SERVICE_FLAGS,
                      gateway_flags=["--discovery-interval-s", "0.1"])
    try:
        cluster.wait_ready(timeout_s=120)
        received: dict[int, list[int]] = {}
        errors: dict[int, grpc.RpcError] = {}

        def stream(i: int) -> None:
            received[i] = []
            try:
                for msg in cluster.stub.GenerateStream(request(i), timeout=90):
                    received[i].extend(msg.token_ids)
            except grpc.RpcError as e:
                errors[i] = e

        # Half are streaming when Redis dies, half start during the outage.
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads[:4]:
            t.start()
        wait_until("streams under way", lambda: sum(
            len(received.get(i, ())) >= 3 for i in range(4)) == 4, 60)
        cluster.kill_redis()
        for t in threads[4:]:
            t.start()
        time.sleep(1.0)  # the outage
        cluster.restart_redis()
        expected = set(cluster.instance_ids.values())
        wait_until("services re-registered", lambda: expected <= cluster.registered(), 30)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a request hangs"

        reference = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", dtype="float32",
                                           num_kv_blocks=512))
        want = reference.generate([list(request(i).prompt_token_ids.ids) for i in range(8)],
                                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                 ignore_eos=True))
        for i, err in errors.items():  # a failure must say what happened
            assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details(), (i, err)
        for i in set(range(8)) - set(errors):
            assert received[i] == want[i].output_token_ids, i
        print(f"completed {8 - len(errors)} of 8; failed: "
              f"{ {i: e.details() for i, e in errors.items()} }")
        assert not errors
        # After the restart: new requests are served, and nothing is left referenced.
        stream(100)
        assert 100 not in errors and len(received[100]) == MAX_TOKENS
        assert cluster.wait_idle(timeout_s=10) == {}
    finally:
        cluster.close()

"""`splitserve up` itself, supervising (--on-service-exit restart): SIGKILL one of two decode
services while streams are in flight (or one of two prefill services just after a burst is
sent); every request completes with the tokens of an undisturbed
run (the in-process engine's, greedy), the dead service is started again, registers and takes
traffic; SIGTERM to `up` then ends every child. The dummy tiny-llama model keeps it short."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.chaos.load import Outcome, Spec
from tests.cluster import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "dummy:tiny-llama"
# Prefill chunks of 64 tokens: a prefill service is busy for a few steps after a burst arrives.
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
                "--max-num-batched-tokens", "64", "--cpu-threads", "1"]


def stream(stub: generation_pb2_grpc.GenerationServiceStub, spec: Spec, out: Outcome) -> None:
    try:
        for msg in stub.GenerateStream(spec.request(), timeout=120):
            out.tokens.extend(msg.token_ids)
            out.finish_reason = msg.finish_reason or out.finish_reason
    except grpc.RpcError as e:
        out.code, out.details = e.code(), e.details()


def burst(stub, tag: str, n: int, max_tokens: int, prompt_len: int,
          ) -> tuple[list[Outcome], list[threading.Thread]]:
    """n greedy streams of distinct token-id prompts, each in its own thread."""
    outcomes = [Outcome(Spec(f"{tag}-{i}", [3 + (7 * i + 13 * j) % 500
                                            for j in range(prompt_len + 3 * i)], max_tokens))
                for i in range(n)]
    threads = [threading.Thread(target=stream, args=(stub, o.spec, o), daemon=True)
               for o in outcomes]
    for t in threads:
        t.start()
    return outcomes, threads


def instance_stats(stub, role: str) -> dict[int, object]:
    """pid -> InstanceStats of each registered `role` instance (ids are <role>-<host>-<pid>)."""
    info = stub.ModelInfo(generation_pb2.ModelInfoRequest(include_instances=True), timeout=5.0)
    return {int(s.instance_id.rsplit("-", 1)[1]): s for s in info.instances if s.role == role}


def busy(s) -> bool:
    return bool(s.num_running or s.num_waiting or s.num_inflight)


# role killed, --num-prefill, --num-decode, prompt length (prefill: several 64-token chunks)
CASES = {"decode": ("decode", 1, 2, 12), "prefill": ("prefill", 2, 1, 200)}


@pytest.mark.parametrize("case", list(CASES))
def test_up_restarts_a_killed_service(tmp_path, case):
    role, num_prefill, num_decode, prompt_len = CASES[case]
    port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--grpc-port", str(port),
             "--num-prefill", str(num_prefill), "--num-decode", str(num_decode), "--model", MODEL, *ENGINE_FLAGS,
             "--restart-backoff-s", "0.2"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    children: list[psutil.Process] = []
    try:
        wait_until("up is up", lambda: up.poll() is None and b"splitserve is up"
                   in log_path.read_bytes() or up.poll() is not None, 120, interval_s=0.2)
        assert up.poll() is None, log_path.read_text()
        children = psutil.Process(up.pid).children()
        before = instance_stats(stub, role)
        assert len(before) == 2

        outcomes, threads = burst(stub, "a", 12, 64, prompt_len)
        working = wait_until(f"a {role} service at work", lambda: [
            pid for pid, s in instance_stats(stub, role).items() if busy(s)], 60, interval_s=0.02)
        victim = working[0]
        psutil.Process(victim).kill()
        for t in threads:
            t.join(120)

        # It comes back: a new process of `up`, registered; the dead one's record expired.
        def restarted():
            now = instance_stats(stub, role)
            return (set(now) - set(before)) if len(now) == 2 and victim not in now else None
        (new_pid,) = wait_until(f"the killed {role} service back", restarted, 60, interval_s=0.1)
        assert new_pid in {p.pid for p in psutil.Process(up.pid).children()}
        log = log_path.read_text()
        assert f"pid={victim} exit=SIGKILL restart=1" in log, log
        assert f"pid={new_pid} restart=1" in log, log

        # And takes traffic again.
        later, later_threads = burst(stub, "b", 8, 48, prompt_len)
        wait_until("the restarted service at work",
                   lambda: busy(instance_stats(stub, role)[new_pid]), 60, interval_s=0.02)
        for t in later_threads:
            t.join(120)

        everything = outcomes + later
        assert [(o.spec.request_id, o.code) for o in everything if o.code is not None] == []
        reference = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", dtype="float32",
                                    num_kv_blocks=1024))
        want = reference.generate([o.spec.prompt for o in everything], [
            SamplingParams(max_tokens=o.spec.max_tokens, temperature=0.0, ignore_eos=True)
            for o in everything])
        wrong = [o.spec.request_id for o, w in zip(everything, want, strict=True)
                 if o.tokens != w.output_token_ids]
        assert wrong == []
        children = psutil.Process(up.pid).children()
    finally:
        channel.close()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0, log_path.read_text()[-3000:]
    time.sleep(0.2)
    assert [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []

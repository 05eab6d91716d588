"""KV handoffs over gRPC with TLS between real processes: a prefill service, a gateway and a decode
service that stands on another host (its hostname differs, so its host id does, and it pulls the
prompt's KV over grpc instead of shm), with mTLS between all of them.

A decode service whose --tls-ca does not verify the prefill service's certificate fails the pull
at once (UNAVAILABLE), recomputes the prompt and answers the same tokens; no block stays
referenced on either service once the handoff's lease has run out.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.registry import EmbeddedRedis, Registry
from common.registry.embedded import free_port
from common.serving.tls import TlsConfig, sync_channel
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from splitserve.launch import service_argv, start_service, stop_services
from tests.certs import make_ca, make_leaf
from tests.cluster import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--num-kv-blocks", "128"]
LEASE_S = 2.0
PROMPT = list(range(10, 60))  # 50 tokens (3 full blocks of 16): prefilled, then handed off
REQUEST = generation_pb2.GenerateRequest(
    prompt_token_ids=generation_pb2.TokenIds(ids=PROMPT),
    params=types_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
# tiny-llama: 2 layers, K and V, 16 tokens of 2 KV heads of 16, float32.
KV_BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4

# `splitserve ...` on "another host": another hostname gives another host id
# (common/kv_transport/locality.py), so the KV of a prefill service here cannot come over shm.
ELSEWHERE = ("import socket, sys; socket.gethostname = lambda: 'decode-elsewhere'; "
             "from splitserve.cli import main; sys.exit(main(sys.argv[1:]))")


class TlsStack:
    """Redis, one prefill service and a gateway serving mTLS; decode services started one at a
    time with the TLS flags a test gives them."""

    def __init__(self, log_dir: Path, pki: Path):
        self.log_dir = log_dir
        self.ca, self.rogue_ca = make_ca(pki, "ca"), make_ca(pki, "rogue-ca")
        self.leaves = {n: make_leaf(pki, n, self.ca) for n in ("prefill", "decode", "gateway")}
        self.redis = EmbeddedRedis()
        self.namespace = f"tls-{uuid.uuid4().hex[:8]}"
        self.registry = Registry(self.redis.url, self.namespace)
        self.procs: dict[str, subprocess.Popen] = {}
        self.decode_metrics_port = 0
        self._launch("prefill-0", self._argv("prefill", [
            *self.leaves["prefill"].tls(self.ca, client_auth=True).to_argv(),
            "--handoff-lease-s", str(LEASE_S), "--instance-id", "prefill-0"]))
        gateway_port = free_port()
        self._launch("gateway", service_argv(
            "gateway", registry_url=self.redis.url, namespace=self.namespace, port=gateway_port,
            model=MODEL, extra=self.leaves["gateway"].tls(self.ca).to_argv()))
        self.channel = sync_channel(f"127.0.0.1:{gateway_port}",
                                    TlsConfig(tls_ca=str(self.ca.cert_path)))
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def _argv(self, role: str, extra: list[str]) -> list[str]:
        return service_argv(role, registry_url=self.redis.url, namespace=self.namespace,
                            model=MODEL, extra=[*ENGINE_FLAGS, *extra])

    def _launch(self, name: str, argv: list[str], elsewhere: bool = False) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            if elsewhere:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-c", ELSEWHERE, *argv[1:]], cwd=ROOT,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            else:
                self.procs[name] = start_service(argv, stdout=log, stderr=subprocess.STDOUT)

    def start_decode(self, name: str, tls: TlsConfig) -> None:
        """Replace the decode service (if any) with one on another host, dialling with tls."""
        for old in [n for n in self.procs if n.startswith("decode")]:
            stop_services([self.procs.pop(old)])  # deregisters on SIGTERM
        self.decode_metrics_port = free_port()
        self._launch(name, self._argv("decode", [
            *tls.to_argv(), "--instance-id", name,
            "--metrics-port", str(self.decode_metrics_port)]), elsewhere=True)
        wait_until(f"{name} to serve", lambda: self.instances() == {"prefill-0", name}, 120,
                   interval_s=0.2)

    def instances(self) -> set[str]:
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead} exited:\n{self.logs(dead)}")
        info = self.stub.ModelInfo(generation_pb2.ModelInfoRequest(include_instances=True),
                                   timeout=5)
        return {s.instance_id for s in info.instances}

    def idle(self) -> bool:
        """No block referenced on any service (the gateway asks them over mTLS), no record."""
        info = self.stub.ModelInfo(generation_pb2.ModelInfoRequest(include_instances=True),
                                   timeout=5)
        busy = [s.instance_id for s in info.instances if s.num_used_blocks]
        records = [k for k in self.registry.namespace_keys() if ":handoff:" in k]
        return not busy and not records

    def decode_counter(self, name: str, **labels: str) -> float:
        url = f"http://127.0.0.1:{self.decode_metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == f"splitserve_{name}" and labels.items() <= s.labels.items():
                    return s.value
        return 0.0

    def logs(self, names: list[str]) -> str:
        return "\n".join(f"--- {n}\n" + (self.log_dir / f"{n}.log").read_text()[-3000:]
                         for n in names)

    def close(self) -> None:
        self.channel.close()
        stop_services(list(self.procs.values()))
        self.registry.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    s = TlsStack(tmp_path_factory.mktemp("tls-logs"), tmp_path_factory.mktemp("tls-pki"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def answer(tls_stack: TlsStack) -> list[int]:
    """The tokens for REQUEST with the KV pulled over mTLS."""
    tls_stack.start_decode("decode-mtls", tls_stack.leaves["decode"].tls(tls_stack.ca,
                                                                        client_auth=True))
    out = tls_stack.stub.Generate(REQUEST, timeout=60)
    assert len(out.token_ids) == 8
    return list(out.token_ids)


def test_handoff_over_mtls_pulls_over_grpc(tls_stack: TlsStack, answer: list[int]):
    # The prompt's 4 blocks (the last one partial) came over grpc; nothing was recomputed.
    assert tls_stack.decode_counter("handoff_bytes_total", transport="grpc") == \
        4 * KV_BYTES_PER_BLOCK
    assert tls_stack.decode_counter("handoff_failures_total", reason="transfer") == 0
    wait_until("the stack to go idle", tls_stack.idle, 10)


def test_tls_handoff_with_the_wrong_ca_fails_and_recomputes(tls_stack: TlsStack,
                                                            answer: list[int]):
    # The decode service's certificate is good (the gateway and the prefill service accept it),
    # but its CA does not verify the prefill service's certificate.
    decode = tls_stack.leaves["decode"]
    tls_stack.start_decode("decode-rogue-ca", TlsConfig(
        tls_cert=str(decode.cert_path), tls_key=str(decode.key_path),
        tls_ca=str(tls_stack.rogue_ca.cert_path)))
    out = tls_stack.stub.Generate(REQUEST, timeout=60)
    assert list(out.token_ids) == answer  # greedy: the recomputed prompt gives the same tokens
    assert tls_stack.decode_counter("handoff_failures_total", reason="transfer") == 1
    assert tls_stack.decode_counter("handoff_bytes_total", transport="grpc") == 0
    log = (tls_stack.log_dir / "decode-rogue-ca.log").read_text()
    assert "over TLS failed: UNAVAILABLE" in log and "CERTIFICATE_VERIFY_FAILED" in log
    # The decode side freed its reserved blocks; the prefill side's go when the lease runs out.
    wait_until("the stack to go idle", tls_stack.idle, LEASE_S + 10)

"""The disaggregated stack at tensor parallel size 2 on CPU ranks (issue 20), real processes:

- prefill TP 2 and decode TP 2: each instance registers once, with its size; every prompt's KV
  moves rank to rank (the decode side's handoff bytes are every rank's shard of every block, over
  shm on one host, over grpc from "another host", none recomputed) and the greedy tokens equal the TP 1 in-process engine's; afterwards both
  pools are full again;
- prefill TP 2 and decode TP 1: the gateway never pairs them; the decode instance prefills each
  prompt itself (no Prefill call, no handoff), with the same tokens;
- one rank of a decode instance SIGKILLed mid-stream: that instance stops (every rank exits, it
  leaves the registry, exit code 1 naming the rank), the gateway migrates its streams to the
  other decode instance, and every client gets the undisturbed tokens; nothing stays held.

dummy:tiny-llama (seeded random weights of a Llama shape, 4 heads and 2 KV heads: one KV head per
rank) keeps each case within a minute or two on two cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.registry.embedded import free_port
from protos.splitserve.v1 import types_pb2
from tests.chaos.load import Outcome, Spec
from tests.cluster import (
    DECODE_FLAGS,
    GATEWAY_FLAGS,
    LEASE_S,
    PREFILL_FLAGS,
    Cluster,
    wait_until,
)
from tests.reliability.test_scale_down import leftovers, stream
from tests.stack.test_tls_handoff import ELSEWHERE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
BLOCK_SIZE = 16
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--block-size", str(BLOCK_SIZE), "--cpu-threads", "1"]
TP2 = ["--tensor-parallel-size", "2"]
# tiny-llama's KV per block, all KV heads: layers x (K, V) x block_size x kv_heads x head_dim x 4
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
SPECS = [Spec(f"tp-{i}", [5 + (13 * i + 7 * j) % 500 for j in range(9 + 11 * i)], 24)
         for i in range(6)]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy outputs of SPECS from one in-process engine at TP 1."""
    engine = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", dtype="float32",
                             num_kv_blocks=256, block_size=BLOCK_SIZE))
    outs = engine.generate([s.prompt for s in SPECS], SamplingParams(
        max_tokens=SPECS[0].max_tokens, temperature=0.0, ignore_eos=True))
    return {s.request_id: o.output_token_ids for s, o in zip(SPECS, outs, strict=True)}


def metric(port: int, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^splitserve_{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def run_all(cluster: Cluster, specs: list[Spec]) -> list[Outcome]:
    outcomes = [Outcome(spec) for spec in specs]
    threads = [threading.Thread(target=stream, args=(cluster.stub, o), daemon=True)
               for o in outcomes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return outcomes


def rank_pids(pid: int) -> list[int]:
    """The tensor-parallel ranks a service started (its child processes)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def pools_of(pids: list[int]) -> list[str]:
    return [f for f in os.listdir("/dev/shm")
            if any(f.startswith(f"splitserve-kv-{pid}-") for pid in pids)]


def alive(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"
    return False


class ElsewhereCluster(Cluster):
    """Its decode services stand on "another host" (tests/stack/test_tls_handoff.py's trick:
    another hostname, so another host id): their ranks pull over grpc, not shm."""

    def _launch(self, slot: str, argv: list[str]) -> subprocess.Popen:
        if not slot.startswith("decode"):
            return super()._launch(slot, argv)
        with open(self.log_dir / f"{slot}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-c", ELSEWHERE, *argv[1:]],
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs[slot] = proc
        self.all_pids.append(proc.pid)
        return proc


@pytest.mark.parametrize("transport", ["shm", "grpc"], ids=["one-host", "decode-elsewhere"])
def test_prefill_tp2_to_decode_tp2_moves_every_rank_shard(tmp_path, reference, transport):
    decode_metrics = free_port()
    cluster = (Cluster if transport == "shm" else ElsewhereCluster)(tmp_path, MODEL, num_prefill=1, num_decode=1,
                      engine_flags=[*ENGINE_FLAGS, *TP2], prefill_flags=PREFILL_FLAGS,
                      decode_flags=[*DECODE_FLAGS, "--metrics-port", str(decode_metrics)],
                      gateway_flags=GATEWAY_FLAGS)
    try:
        cluster.wait_ready(timeout_s=180)
        records = {i.kind: i for kind in ("prefill", "decode")
                   for i in cluster.registry.list_instances(kind)}
        assert {k: (i.instance_id, i.tensor_parallel_size) for k, i in records.items()} == {
            "prefill": ("prefill-0-g1", 2), "decode": ("decode-0-g1", 2)}
        assert len(rank_pids(cluster.procs["decode-0"].pid)) == 1  # rank 1; rank 0 is itself
        prefill_ranks = [cluster.procs["prefill-0"].pid, *rank_pids(cluster.procs["prefill-0"].pid)]
        assert len(pools_of(prefill_ranks)) == 2  # each prefill rank's pool is a /dev/shm file

        outcomes = run_all(cluster, SPECS)
        assert {o.spec.request_id: (o.code, o.tokens) for o in outcomes} == {
            rid: (None, tokens) for rid, tokens in reference.items()}, cluster.logs()
        # Every prompt's KV came over the handoff, every rank's shard of every block over the
        # transport (rank 0's name: every rank chooses by the same host id).
        blocks = sum(-(-len(s.prompt) // BLOCK_SIZE) for s in SPECS)
        label = f'transport="{transport}"'
        assert metric(decode_metrics, "handoff_bytes_total", label) == blocks * BLOCK_BYTES
        assert metric(decode_metrics, "handoff_seconds_count", label) == len(SPECS)
        assert metric(decode_metrics, "handoff_failures_total", 'reason="transfer"') == 0
        assert cluster.wait_idle(timeout_s=LEASE_S + 10) == {}
        assert leftovers(cluster) == {}
    finally:
        cluster.close()
    assert pools_of(prefill_ranks) == []  # every rank's pool file went with its rank


def test_prefill_tp2_is_never_paired_with_decode_tp1(tmp_path, reference):
    cluster = Cluster(tmp_path, MODEL, num_prefill=1, num_decode=1, engine_flags=ENGINE_FLAGS,
                      prefill_flags=[*PREFILL_FLAGS, *TP2], decode_flags=DECODE_FLAGS,
                      gateway_flags=GATEWAY_FLAGS)
    try:
        cluster.wait_ready(timeout_s=180)
        sizes = {i.kind: i.tensor_parallel_size for kind in ("prefill", "decode")
                 for i in cluster.registry.list_instances(kind)}
        assert sizes == {"prefill": 2, "decode": 1}
        outcomes = run_all(cluster, SPECS[:3])
        assert {o.spec.request_id: (o.code, o.tokens) for o in outcomes} == {
            s.request_id: (None, reference[s.request_id]) for s in SPECS[:3]}, cluster.logs()
        # The decode instance prefilled them itself: the prefill instance never saw them.
        prefill = cluster.stats()[cluster.instance_ids["prefill-0"]]
        assert prefill.num_cached_blocks == 0
        assert "no prefill instance runs at tensor parallel size 1 like decode instance " \
            "decode-0-g1 (sizes: [2])" in (tmp_path / "gateway.log").read_text()
        assert leftovers(cluster) == {}
    finally:
        cluster.close()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"], ids=["dies", "hangs"])
def test_a_decode_rank_killed_mid_stream(tmp_path, reference, how):
    """SIGKILL: rank 0 sees the rank exit at once. SIGSTOP: a hung rank, caught by the
    collective timeout (--tp-timeout-s 8), then killed when its instance closes its ranks."""
    specs = [Spec(f"kill-{i}", s.prompt, 200) for i, s in enumerate(SPECS)]
    engine = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", dtype="float32",
                             num_kv_blocks=256, block_size=BLOCK_SIZE))
    want = [o.output_token_ids for o in engine.generate(
        [s.prompt for s in specs], SamplingParams(max_tokens=200, temperature=0.0,
                                                  ignore_eos=True))]
    cluster = Cluster(tmp_path, MODEL, num_prefill=1, num_decode=2,
                      engine_flags=[*ENGINE_FLAGS, *TP2], prefill_flags=PREFILL_FLAGS,
                      decode_flags=[*DECODE_FLAGS, "--tp-timeout-s", "8"],
                      gateway_flags=GATEWAY_FLAGS)
    ranks: list[int] = []
    try:
        cluster.wait_ready(timeout_s=180)
        outcomes = [Outcome(spec) for spec in specs]
        threads = [threading.Thread(target=stream, args=(cluster.stub, o), daemon=True)
                   for o in outcomes]
        for t in threads:
            t.start()
        wait_until("every stream under way", lambda: all(len(o.tokens) >= 3 for o in outcomes),
                   60, interval_s=0.01)
        stats = cluster.stats()
        running = {slot: stats[cluster.instance_ids[slot]].num_running
                   for slot in ("decode-0", "decode-1")}
        victim = max(running, key=running.get)
        victim_id = cluster.instance_ids[victim]
        proc = cluster.procs[victim]
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 1
        received = [len(o.tokens) for o in outcomes]
        killed = time.monotonic()
        subprocess.run(["kill", f"-{how}", str(ranks[0])], check=True)  # rank 1 of the victim
        exit_code = proc.wait(timeout=60)
        exit_s = time.monotonic() - killed
        del cluster.instance_ids[victim]
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert running[victim] >= 1 and all(n < 200 for n in received)
        assert exit_code == 1, cluster.logs([victim])
        # Its rank 0 saw rank 1 exit (or its collective break first, whichever came first).
        assert f"decode {victim_id} stopped: tensor parallel " \
            in (tmp_path / f"{victim}.log").read_text()
        assert not any(alive(pid) for pid in [proc.pid, *ranks])
        assert victim_id not in cluster.registered()
        assert exit_s < (30 if how == "SIGKILL" else 45)
        assert {o.spec.request_id: (o.code, o.tokens) for o in outcomes} == {
            s.request_id: (None, w) for s, w in zip(specs, want, strict=True)}, \
            cluster.logs(["gateway", victim])
        assert all(o.finish_reason == types_pb2.FINISH_REASON_LENGTH for o in outcomes)
        assert sum(o.migrations for o in outcomes) >= 1
        with contextlib.suppress(TimeoutError):
            wait_until("the stack idle", lambda: not leftovers(cluster), LEASE_S + 10)
        assert leftovers(cluster) == {}
    finally:
        for pid in ranks:  # a frozen rank the test left behind, if it failed early
            if alive(pid):
                subprocess.run(["kill", "-KILL", str(pid)], check=False)
        cluster.close()


def test_smollm2_prefill_tp3_to_decode_tp3(tmp_path, model_cache_dir):
    """The real model at size 3 (9 heads and 3 KV heads: one KV head per rank): the stack's
    greedy tokens equal the TP 1 in-process engine's, and every rank's shard moved."""
    engine = LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), device="cpu",
                             dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE))
    prompts = [engine.tokenizer.encode(f"Tell me one fact about {topic}.")
               for topic in ("the moon", "bread", "chess")]
    specs = [Spec(f"smol-{i}", p, 8) for i, p in enumerate(prompts)]
    want = {s.request_id: o.output_token_ids for s, o in zip(specs, engine.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)), strict=True)}
    del engine
    decode_metrics = free_port()
    flags = ["--model-cache-dir", str(model_cache_dir), "--device", "cpu", "--dtype", "float32",
             "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE), "--cpu-threads", "1",
             "--tensor-parallel-size", "3"]
    cluster = Cluster(tmp_path, "SmolLM2-135M-Instruct", num_prefill=1, num_decode=1,
                      engine_flags=flags, prefill_flags=PREFILL_FLAGS,
                      decode_flags=[*DECODE_FLAGS, "--metrics-port", str(decode_metrics)],
                      gateway_flags=GATEWAY_FLAGS)
    try:
        cluster.wait_ready(timeout_s=240)
        outcomes = run_all(cluster, specs)
        assert {o.spec.request_id: (o.code, o.tokens) for o in outcomes} == {
            rid: (None, tokens) for rid, tokens in want.items()}, cluster.logs()
        # SmolLM2's KV per block, all 3 KV heads: 30 layers x 2 x 16 x 3 x 64 x 4 bytes.
        blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
        assert metric(decode_metrics, "handoff_bytes_total", 'transport="shm"') \
            == blocks * 30 * 2 * BLOCK_SIZE * 3 * 64 * 4
        assert metric(decode_metrics, "handoff_failures_total", 'reason="transfer"') == 0
        assert cluster.wait_idle(timeout_s=LEASE_S + 10) == {}
    finally:
        cluster.close()

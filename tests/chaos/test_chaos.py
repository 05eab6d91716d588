"""The chaos suite (issue 7, "Show"): under concurrent load, SIGKILL and restart decode, prefill and
Redis processes, and check that

- every request completes or gets a clear status (nothing hangs),
- the greedy outputs of every completed request, migrated or not, equal an undisturbed run's
  (the in-process engine's): no token lost, repeated or changed,
- once the leases expire, no live service references a KV block or waits for a delivery,
- after a graceful stop the registry namespace is empty and no shared-memory pool is left.

Real processes on loopback, the dummy tiny-llama model (seeded random weights: the same in every
process) and token-id prompts keep it within a couple of minutes on two cores.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from protos.splitserve.v1 import types_pb2
from tests.chaos.load import Load
from tests.cluster import (
    DECODE_FLAGS,
    GATEWAY_FLAGS,
    LEASE_S,
    PREFILL_FLAGS,
    Cluster,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
VOCAB = 512
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
                "--max-num-batched-tokens", "1024"]
# What to kill (SIGKILL), in order; "freeze:" hangs the process (SIGSTOP) until every stream in
# flight has moved on without it (gRPC keepalive), then kills it.
FAULTS = ["decode-0", "prefill-0", "redis", "decode-1", "prefill-1", "freeze:decode-0"]


def inject(cluster: Cluster, load: Load, fault: str) -> dict:
    """Break `fault`'s target while streams are in flight, restart it, wait until it is back."""
    wait_until("streams in flight", lambda: load.streaming(min_tokens=3) >= 3, 60)
    hang = fault.startswith("freeze:")
    target = fault.removeprefix("freeze:")
    if target.startswith("decode"):  # break it while it is generating
        instance = cluster.instance_ids[target]
        wait_until(f"{instance} generating",
                   lambda: cluster.stats().get(instance, types_pb2.InstanceStats()).num_running,
                   30, interval_s=0.02)
    report = {"fault": f"{'hang, then kill' if hang else 'kill'} {target}",
              "in_flight": len(load.receiving)}
    start = time.monotonic()
    if target == "redis":
        cluster.kill_redis()
        time.sleep(1.0)  # the outage itself
        cluster.restart_redis()
        instances = set(cluster.instance_ids.values())
        wait_until("services re-registered", lambda: instances <= cluster.registered(), 30)
    else:
        if hang:
            # The stats that said it was generating are up to 0.1 s old, so its streams may all
            # have ended by the time it stops: then let it go on and try again.
            for _ in range(5):
                cluster.freeze(target)
                time.sleep(0.3)  # what the process sent before it stopped arrives meanwhile
                before = dict(load.receiving)
                time.sleep(1.0)
                seen = dict(load.receiving)
                report["stalled"] = sum(before.get(rid) == n for rid, n in seen.items())
                if report["stalled"]:
                    break
                cluster.thaw(target)
                wait_until(f"{instance} generating", lambda: cluster.stats().get(
                    instance, types_pb2.InstanceStats()).num_running, 30, interval_s=0.02)
            # Every stream must get past the hang (the gateway's keepalive notices it); none
            # may wait for the process to come back.
            wait_until("streams moved on from the hung process", lambda: all(
                load.receiving.get(rid, n + 1) > n for rid, n in seen.items()), 60)
        report["pid"] = cluster.kill(target)
        instance = cluster.start(target)
        wait_until(f"{instance} registered", lambda: instance in cluster.registered(), 90,
                   interval_s=0.1)
    report["recovered_s"] = round(time.monotonic() - start, 2)
    return report


def test_chaos(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    cluster = Cluster(log_dir, MODEL, engine_flags=ENGINE_FLAGS, prefill_flags=PREFILL_FLAGS,
                      decode_flags=DECODE_FLAGS, gateway_flags=GATEWAY_FLAGS)
    try:
        cluster.wait_ready(timeout_s=120)
        load = Load(cluster.stub, concurrency=8, seed=7, vocab_size=VOCAB,
                    prompt_len=(8, 160), max_tokens=(48, 128), timeout_s=120).start()
        faults = [inject(cluster, load, target) for target in FAULTS]
        load.stop(timeout_s=120)
        outcomes = load.outcomes

        reference = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", dtype="float32",
                                           num_kv_blocks=4096, max_num_seqs=512))
        want = reference.generate(
            [o.spec.prompt for o in outcomes],
            [SamplingParams(max_tokens=o.spec.max_tokens, temperature=0.0, ignore_eos=True)
             for o in outcomes])
        completed = [(o, w) for o, w in zip(outcomes, want, strict=True) if o.code is None]
        wrong = {o.spec.request_id: (len(o.tokens), len(w.output_token_ids))
                 for o, w in completed if o.tokens != w.output_token_ids}
        tokens_lost = sum(max(0, len(w.output_token_ids) - len(o.tokens)) for o, w in completed)

        leaked = cluster.wait_idle(timeout_s=LEASE_S + 10)
        gateway_log = (log_dir / "gateway.log").read_text()
        migrated = [o for o, _ in completed if o.migrations]
        retried = len(re.findall(r"failed after 0 tokens", gateway_log))
        codes = cluster.stop()
        registry_left = cluster.registry.namespace_keys()
        shm_left = cluster.stale_shm_files()
        summary = {
            "requests": len(outcomes), "completed": len(completed),
            "failed": dict(load.failures()), "faults": faults,
            "requests_migrated": len(migrated),
            "migrations": sum(o.migrations for o in migrated),
            "retried_before_first_token": retried,
            "tokens_lost": tokens_lost, "wrong_outputs": wrong, "blocks_leaked": leaked,
            "registry_left": registry_left, "shm_left": shm_left, "exit_codes": codes,
        }
        print("chaos summary:", json.dumps(summary, indent=1, default=str))
        (tmp_path / "chaos_summary.json").write_text(json.dumps(summary, default=str))

        assert len(faults) == len(FAULTS)
        assert all(f.get("stalled", 1) > 0 for f in faults)  # the hang did hold streams up
        assert all(o.code is None or o.details for o in outcomes)  # a clear status
        assert not wrong and tokens_lost == 0
        assert all(o.finish_reason == types_pb2.FINISH_REASON_LENGTH for o, _ in completed)
        assert not leaked
        assert set(codes.values()) == {0}, codes
        assert registry_left == [] and shm_left == []
        assert len(completed) == len(outcomes), dict(load.failures())
        assert migrated  # some requests did move, and their outputs are among the checked
    finally:
        cluster.close()

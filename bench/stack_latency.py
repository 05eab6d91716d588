"""Latency of the disaggregated gRPC stack against the in-process engine, in one run.

    .venv/bin/python bench/stack_latency.py [--requests 20] [--out out/stack_latency.json]

On CPU by default (the real SmolLM2). On GPUs, e.g. prefill and decode as separate processes on
one GPU (KV handed over through CUDA IPC) or on two GPUs (peer copy):

    python3 bench/stack_latency.py --model dummy:llama-3-8b --prefill-device cuda:0 \
        --decode-device cuda:1 --local-device cuda:0 --engine-flags="--dtype bfloat16 ..."

Starts a private redis-server, one prefill, one decode and one gateway process (the command lines
of splitserve.launch), and loads the same engine in this process. Requests run one at a time
(batch 1), alternating between the two paths, with distinct random prompts (no prefix-cache
hits), greedy, EOS ignored:

- TTFT: from sending the request to receiving the first token (client side of the gateway; from
  add_request to the first output in process, stepping on another thread than the one that
  built the engine, as the services do).
  Target: stack p50 within 1 ms of in-process p50. Also shown without the engine's own
  arrival-to-first-token time, which takes the model's compute (and most noise) out.
  The same without the engine's time while one other stream decodes through the stack
  (--hot-requests; target: within 1 ms of the in-process engine's), and after idle against the
  floor of two gRPC hops measured in this run (bench/grpc_floor.py's two_hop_floor, at the idle
  gap the stack's requests had; target: within 0.5 ms of it).
- ITL: time between consecutive tokens. Target: within 0.3 ms at p50.
- Handoff: for 512-token prompts, its part on the critical path / prefill compute time. The
  critical path runs from the prefill engine's first token to the request queued for the decode
  engine's next step with its KV in place and verified (StageTimings.handoff_critical_ms, the
  two services' wall clocks on one host). Shown beside it: the prefill side's whole delivery
  call (checksum, Deliver, the decode side's pull and verification, the reply) and the decode
  side's own share (Deliver's arrival to verified). Target: at most 5 %.
  With --load-streams N, the same handoffs again while N other streams keep the decode busy.
- Token 2: the gap between the first and the second token through the stack (the decode's first
  step after the handoff), against the stack's median ITL. Target: at most 1.3x.

Prints a table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.registry import EmbeddedRedis, Registry
from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from splitserve.launch import service_argv, start_service, stop_services

sys.path.insert(0, str(Path(__file__).parent))
from grpc_floor import two_hop_floor  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20, help="timed requests per path")
    p.add_argument("--warmup", type=int, default=3, help="untimed requests per path first")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length for TTFT/ITL")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--handoff-prompt-tokens", type=int, default=512,
                   help="prompt length for the handoff fraction")
    p.add_argument("--handoff-requests", type=int, default=5, help="requests for the handoff")
    p.add_argument("--load-streams", type=int, default=0,
                   help="then repeat the handoff requests while this many other streams decode "
                        "(the decode engine busy: a pull waits for step boundaries and queued "
                        "steps); 0 = skip")
    p.add_argument("--load-max-tokens", type=int, default=1024,
                   help="tokens each --load-streams stream may generate (capped by the model's "
                        "length; must outlast the loaded handoffs)")
    p.add_argument("--hot-requests", type=int, default=20,
                   help="TTFT requests through the stack while one other stream decodes there "
                        "(0 = skip)")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="KV pool of every engine")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model of every engine")
    p.add_argument("--prefill-device", default="auto", help="--device of the prefill service")
    p.add_argument("--decode-device", default="auto", help="--device of the decode service")
    p.add_argument("--local-device", default="auto", help="device of the in-process engine")
    p.add_argument("--engine-flags", default="",
                   help="more engine flags for both services (the in-process engine gets the "
                        "same settings where EngineConfig has them)")
    p.add_argument("--prefill-flags", default="",
                   help="more flags for the prefill service alone (e.g. --no-early-handoff)")
    p.add_argument("--decode-flags", default="",
                   help="more flags for the decode service alone (e.g. "
                        "--no-early-copy-on-device)")
    p.add_argument("--vocab", type=int, default=40000, help="prompt token ids are below this")
    p.add_argument("--out", default="out/stack_latency.json", help="where to write the JSON")
    return p.parse_args()


def random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(min(100, vocab // 2), vocab) for _ in range(length)]
            for _ in range(n)]


def in_process(engine: LLMEngine, prompt: list[int], max_tokens: int,
               ) -> tuple[list[float], float]:
    """Arrival times (perf_counter) of each token, the request submitted at the first entry;
    and the engine's own time from arrival to the first token, in ms."""
    rid = f"bench-{time.monotonic_ns()}"
    times = [time.perf_counter()]
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))
    engine_ttft = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            times.extend([time.perf_counter()] * len(out.new_token_ids))
            if len(times) == 2:
                m = out.metrics
                engine_ttft = (m.first_token_time - m.arrival_time) * 1e3
    return times, engine_ttft


def through_stack(stub: generation_pb2_grpc.GenerationServiceStub, prompt: list[int],
                  max_tokens: int) -> tuple[list[float], types_pb2.StageTimings]:
    request = generation_pb2.GenerateStreamRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times = [time.perf_counter()]
    timings = None
    for msg in stub.GenerateStream(request, timeout=600):
        times.extend([time.perf_counter()] * len(msg.token_ids))
        if msg.finish_reason:
            timings = msg.timings
    assert len(times) == max_tokens + 1 and timings is not None
    return times, timings


def latencies(runs: list[list[float]]) -> tuple[list[float], list[float]]:
    """TTFTs and inter-token gaps in milliseconds."""
    ttft = [(r[1] - r[0]) * 1e3 for r in runs]
    itl = [(b - a) * 1e3 for r in runs for a, b in zip(r[1:], r[2:], strict=False)]
    return ttft, itl


def start_stack(args: argparse.Namespace, log_dir: Path):
    redis = EmbeddedRedis()
    registry = Registry(redis.url, "bench")
    flags = ["--num-kv-blocks", str(args.num_kv_blocks), *shlex.split(args.engine_flags)]
    port = free_port()
    args.decode_metrics_port = free_port()
    procs = []
    for role, extra, p, metrics in (
            ("prefill", [*flags, "--device", args.prefill_device,
                         *shlex.split(args.prefill_flags)], 0, 0),
            ("decode", [*flags, "--device", args.decode_device,
                        *shlex.split(args.decode_flags)], 0, args.decode_metrics_port),
            ("gateway", [], port, 0)):
        log = open(log_dir / f"{role}.log", "wb")  # noqa: SIM115 (the child keeps it)
        procs.append(start_service(service_argv(role, registry_url=redis.url, namespace="bench",
                                                port=p, model=args.model, metrics_port=metrics,
                                                extra=extra),
                                   stdout=log, stderr=log))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a service exited; logs in {log_dir}")
        try:
            info = stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=2)
            if info.num_prefill_instances and info.num_decode_instances:
                return redis, registry, procs, channel, stub
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the stack did not come up")


class Background:
    """Streams that keep the decode engine busy until stop() (each generates up to max_tokens:
    make that long enough to outlast the measurement)."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, prompts: list[list[int]],
                 max_tokens: int):
        self.received = [0] * len(prompts)
        self.calls = [stub.GenerateStream(generation_pb2.GenerateStreamRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=p),
            params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                            ignore_eos=True)), timeout=600) for p in prompts]
        self.pool = ThreadPoolExecutor(len(prompts))
        self.done = [self.pool.submit(self._drain, i) for i in range(len(prompts))]

    def _drain(self, i: int) -> None:
        try:
            for msg in self.calls[i]:
                self.received[i] += len(msg.token_ids)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise

    def wait_decoding(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while min(self.received) < 2:
            if time.monotonic() > deadline or any(f.done() for f in self.done):
                raise RuntimeError(f"background streams did not start: {self.received}")
            time.sleep(0.05)

    def stop(self) -> int:
        """Cancel every stream; the tokens they received."""
        for call in self.calls:
            call.cancel()
        for f in self.done:
            f.result()
        self.pool.shutdown()
        return sum(self.received)


def handoff_summary(handoffs: list[types_pb2.StageTimings], prompt_tokens: int) -> dict:
    # handoff_critical_ms: the prefill engine's first token -> the request queued for the
    # decode engine's next step with its KV in place and verified (the critical path).
    # handoff_publish_ms: the prefill side's whole delivery call, reply included, which
    # contains the decode side's pull.
    return {
        "prompt_tokens": prompt_tokens,
        "prefill_compute_ms_p50": p50([t.prefill_compute_ms for t in handoffs]),
        "critical_ms_p50": p50([t.handoff_critical_ms for t in handoffs]),
        "deliver_ms_p50": p50([t.handoff_publish_ms for t in handoffs]),
        "decode_pull_verify_ms_p50": p50([t.handoff_ms for t in handoffs]),
        "fraction_p50": p50([t.handoff_critical_ms / t.prefill_compute_ms for t in handoffs]),
        "deliver_fraction_p50": p50([t.handoff_publish_ms / t.prefill_compute_ms
                                     for t in handoffs]),
    }


def handoff_bytes_by_transport(metrics_port: int) -> dict[str, float]:
    """The decode service's splitserve_handoff_bytes_total by transport label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("splitserve_handoff_bytes_total{"):
            labels, value = line.rsplit(" ", 1)
            transport = labels.split('transport="', 1)[1].split('"', 1)[0]
            out[transport] = float(value)
    return out


def local_config(args: argparse.Namespace) -> EngineConfig:
    """The in-process engine: --model, --local-device and the --engine-flags EngineConfig knows."""
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    known, _ = parser.parse_known_args(shlex.split(args.engine_flags))
    return EngineConfig.from_cli_args(known, model=args.model, device=args.local_device,
                                      num_kv_blocks=args.num_kv_blocks)


def p50(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="stack-latency-"))
    redis, registry, procs, channel, stub = start_stack(args, log_dir)
    try:
        # Built here, stepped on another thread, as the services do it (EngineLoop): on the
        # 2-core box, steps on the thread that built the engine run several times slower.
        engine = LLMEngine(local_config(args))
        worker = ThreadPoolExecutor(1)
        local, stack = [], []
        # Alternating the two paths request by request exposes both to the same machine load.
        for i, prompt in enumerate(random_prompts(rng, args.warmup + args.requests,
                                                  args.prompt_tokens, args.vocab)):
            a = worker.submit(in_process, engine, prompt, args.max_tokens).result()
            b = through_stack(stub, prompt, args.max_tokens)
            if i >= args.warmup:
                local.append(a)
                stack.append(b)
        worker.shutdown()
        # The same requests through the stack while one other stream decodes there: the
        # gateway and the decode service busy, as a serving stack is (the issue's "at least one
        # request in flight").
        hot: list[tuple[list[float], types_pb2.StageTimings]] = []
        if args.hot_requests:
            busy = Background(stub, random_prompts(rng, 1, args.prompt_tokens, args.vocab),
                              max_tokens=args.load_max_tokens)
            try:
                busy.wait_decoding()
                hot = [through_stack(stub, prompt, args.max_tokens) for prompt in
                       random_prompts(rng, args.hot_requests, args.prompt_tokens, args.vocab)]
            finally:
                busy.stop()
        handoff_prompts = random_prompts(rng, args.handoff_requests, args.handoff_prompt_tokens,
                                         args.vocab)
        handoffs = [through_stack(stub, p, 2)[1] for p in handoff_prompts]
        loaded, load_tokens = [], 0
        if args.load_streams:
            limit = stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=5).max_model_len
            per_stream = args.load_max_tokens  # limit 0: the gateway does not know it (dummy)
            if limit:
                per_stream = min(per_stream, limit - args.prompt_tokens)
            load = Background(stub, random_prompts(rng, args.load_streams, args.prompt_tokens,
                                                   args.vocab),
                              max_tokens=per_stream)
            try:
                load.wait_decoding()
                loaded = [through_stack(stub, p, 2)[1] for p in handoff_prompts]
            finally:
                load_tokens = load.stop()
        transports = handoff_bytes_by_transport(args.decode_metrics_port)
    finally:
        channel.close()
        stop_services(procs)
        registry.close()
        redis.stop()

    # The floor under the stack's two hops, in this run: a blocking client -> a relay server
    # -> an answering server, after the idle gap the stack's requests had (an in-process
    # request's length, p50) and hot.
    idle_ms = p50([(times[-1] - times[0]) * 1e3 for times, _ in local])
    floor = two_hop_floor(idle_ms, args.requests)
    local_ttft, local_itl = latencies([times for times, _ in local])
    stack_ttft, stack_itl = latencies([times for times, _ in stack])
    token2_gap = [(r[2] - r[1]) * 1e3 for r, _ in stack]
    # TTFT minus the engine's own arrival-to-first-token time: what the path around the engine
    # costs (threads, gRPC hops, gateway), with the model's compute and its noise taken out.
    local_around = [t - e for t, (_, e) in zip(local_ttft, local, strict=True)]
    stack_around = [t - (s.prefill_queue_ms + s.prefill_compute_ms)
                    for t, (_, s) in zip(stack_ttft, stack, strict=True)]
    # Where the stack's part goes, from the gateway's StageTimings: the client <-> gateway
    # call (TTFT seen by the client minus the gateway's own), the gateway before its Prefill
    # call (routing), and that call around the engine (gRPC both ways, the service's hops).
    split = {
        "client_gateway": p50([t - s.ttft_ms for t, (_, s) in
                               zip(stack_ttft, stack, strict=True)]),
        "gateway_routing": p50([s.gateway_ms for _, s in stack]),
        "prefill_call_around_engine": p50([s.ttft_ms - s.gateway_ms - s.prefill_queue_ms
                                           - s.prefill_compute_ms for _, s in stack]),
    }
    hot_around = [(t[1] - t[0]) * 1e3 - (s.prefill_queue_ms + s.prefill_compute_ms)
                  for t, s in hot]
    after_idle_overhead = p50(stack_around) - p50(local_around)
    result = {
        "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "model": args.model,
        "devices": {"prefill": args.prefill_device, "decode": args.decode_device,
                    "in_process": args.local_device},
        "ttft_ms_p50": {"in_process": p50(local_ttft), "stack": p50(stack_ttft)},
        "itl_ms_p50": {"in_process": p50(local_itl), "stack": p50(stack_itl)},
        "ttft_overhead_ms_p50": p50(stack_ttft) - p50(local_ttft),
        "ttft_outside_engine_ms_p50": {"in_process": p50(local_around),
                                       "stack": p50(stack_around)},
        "itl_overhead_ms_p50": p50(stack_itl) - p50(local_itl),
        # TTFT outside the engine: the stack's minus the in-process engine's.
        "ttft_outside_engine_overhead_ms_p50": {
            "after_idle": after_idle_overhead,
            "one_stream_in_flight": p50(hot_around) - p50(local_around) if hot else None},
        "two_hop_floor_ms_p50": floor,
        "after_idle_over_two_hop_floor_ms": after_idle_overhead - floor["after_idle_ms_p50"],
        "token2_gap_ms_p50": p50(token2_gap),
        "token2_gap_over_itl": p50(token2_gap) / p50(stack_itl),
        "ttft_stack_split_ms_p50": split,
        "handoff": {**handoff_summary(handoffs, args.handoff_prompt_tokens),
                    "bytes_by_transport": transports},
        "targets": {"ttft_overhead_ms": 1.0, "itl_overhead_ms": 0.3, "handoff_fraction": 0.05,
                    "token2_gap_over_itl": 1.3, "after_idle_over_two_hop_floor_ms": 0.5},
    }
    h = result["handoff"]
    rows = [
        ("TTFT p50 (ms)", p50(local_ttft), p50(stack_ttft), result["ttft_overhead_ms_p50"], "<= 1.0"),
        ("  outside engine", p50(local_around), p50(stack_around),
         p50(stack_around) - p50(local_around), "<= 1.0"),
        ("ITL p50 (ms)", p50(local_itl), p50(stack_itl), result["itl_overhead_ms_p50"], "<= 0.3"),
    ]
    print(f"\n{'metric':<16}{'in-process':>12}{'stack':>12}{'overhead':>12}  target")
    for name, a, b, d, target in rows:
        print(f"{name:<16}{a:>12.2f}{b:>12.2f}{d:>12.2f}  {target}")
    if hot:
        print(f"{'  in flight':<16}{p50(local_around):>12.2f}{p50(hot_around):>12.2f}"
              f"{p50(hot_around) - p50(local_around):>12.2f}  <= 1.0 (outside the engine, one "
              f"other stream decoding through the stack)")
    print(f"after idle, outside the engine: {after_idle_overhead:.2f} ms over in-process; two "
          f"hops' floor after {floor['gap_ms']:.0f} ms idle {floor['after_idle_ms_p50']:.2f} ms "
          f"(hot {floor['hot_ms_p50']:.2f}): "
          f"{result['after_idle_over_two_hop_floor_ms']:+.2f} ms (target <= +0.5)")
    print("  the stack's part, p50: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f} ms"
                                                   for k, v in split.items()))
    print(f"token 1 -> 2 gap p50 {result['token2_gap_ms_p50']:.2f} ms = "
          f"{result['token2_gap_over_itl']:.2f}x the stack's ITL p50 (target <= 1.3x)")
    print(f"\nhandoff of a {h['prompt_tokens']}-token prompt: critical path "
          f"{h['critical_ms_p50']:.2f} ms over prefill {h['prefill_compute_ms_p50']:.1f} ms = "
          f"{100 * h['fraction_p50']:.1f} % (target <= 5 %); the whole delivery call "
          f"{h['deliver_ms_p50']:.2f} ms (of it the decode's pull + verify "
          f"{h['decode_pull_verify_ms_p50']:.2f} ms); bytes by transport {transports}")
    if loaded:
        result["handoff_under_load"] = {**handoff_summary(loaded, args.handoff_prompt_tokens),
                                        "streams": args.load_streams,
                                        "their_tokens": load_tokens}
        h = result["handoff_under_load"]
        print(f"the same while {args.load_streams} streams decode: critical path "
              f"{h['critical_ms_p50']:.2f} ms over prefill {h['prefill_compute_ms_p50']:.1f} ms "
              f"= {100 * h['fraction_p50']:.1f} %; delivery call {h['deliver_ms_p50']:.2f} ms "
              f"(decode's pull + verify {h['decode_pull_verify_ms_p50']:.2f} ms)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

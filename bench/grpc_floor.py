"""The latency floor under the stack's TTFT (T9): what one Python gRPC hop and one TCP round
trip cost on this machine, back to back and after the threads have slept.

    .venv/bin/python bench/grpc_floor.py [--out out/grpc_floor.json]

A server process answers a Prefill call with one PrefillResponse of the size the stack sends
(grpc.aio, GrpcServer with its interceptors and channel options, as the services run it), and a
raw TCP echo answers one byte. The client times, after an idle gap of 0, 1, 10, 50 and 200 ms:

- the gRPC call until its first message (what the gateway waits for per hop) and until its end;
- the TCP round trip (two thread wake-ups and nothing else);
- and two hops in a row (a blocking client -> a relay server -> the answering server), hot and
  after 50 ms of idle: the floor of the stack's TTFT path (bench/stack_latency.py measures it
  in its own run).

The stack's TTFT path has two such calls (client -> gateway, gateway -> prefill) plus the
engine thread's two hand-offs, each after the services idled through the prefill compute.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

from common.registry.embedded import free_port
from common.serving import grpc_util
from protos.splitserve.v1 import prefill_pb2, prefill_pb2_grpc, types_pb2

GAPS_MS = (0, 1, 10, 50, 200)


class _Answer(prefill_pb2_grpc.PrefillServiceServicer):
    async def Prefill(self, request, context):
        yield prefill_pb2.PrefillResponse(request_id=request.request_id, first_token_id=5,
                                          queue_ms=0.1, compute_ms=1.0, instance_id="floor")


def _grpc_server(port: int) -> None:
    async def main() -> None:
        server = grpc_util.GrpcServer("127.0.0.1", port)
        server.add(grpc_util.Service(_Answer(), prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                                     "splitserve.v1.PrefillService"))
        await server.start()
        await server.server.wait_for_termination()

    asyncio.run(main())


class _Relay(prefill_pb2_grpc.PrefillServiceServicer):
    """Forwards each Prefill call to the answering server, as the gateway forwards a request."""

    def __init__(self, upstream: str):
        self.stub = prefill_pb2_grpc.PrefillServiceStub(grpc_util.insecure_channel(upstream))

    async def Prefill(self, request, context):
        async for msg in self.stub.Prefill(request, timeout=30):
            yield msg


def _relay_server(port: int, upstream_port: int) -> None:
    async def main() -> None:
        server = grpc_util.GrpcServer("127.0.0.1", port)
        server.add(grpc_util.Service(_Relay(f"127.0.0.1:{upstream_port}"),
                                     prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                                     "splitserve.v1.PrefillService"))
        await server.start()
        await server.server.wait_for_termination()

    asyncio.run(main())


def two_hop_floor(gap_ms: float, n: int) -> dict:
    """The stack's two hops with nothing else: a blocking client (as bench/stack_latency.py's)
    calls a relay server, which calls an answering server; the first message's arrival after
    `gap_ms` of idle, p50 over n calls (in ms), and hot (no gap)."""
    import grpc

    answer_port, relay_port = free_port(), free_port()
    servers = [mp.Process(target=_grpc_server, args=(answer_port,), daemon=True),
               mp.Process(target=_relay_server, args=(relay_port, answer_port), daemon=True)]
    for p in servers:
        p.start()
    request = prefill_pb2.PrefillRequest(
        request_id="r" * 41, prompt_token_ids=list(range(1000, 1064)),
        params=types_pb2.SamplingParams(max_tokens=32, temperature=0.0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{relay_port}") as channel:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            deadline = time.monotonic() + 30
            while True:
                try:
                    list(stub.Prefill(request, timeout=5))
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            out = {}
            for name, gap in (("hot", 0.0), ("after_idle", gap_ms)):
                times = []
                for i in range(n + 5):
                    time.sleep(gap / 1e3)
                    t = time.perf_counter()
                    stream = stub.Prefill(request, timeout=30)
                    next(stream)
                    if i >= 5:
                        times.append((time.perf_counter() - t) * 1e3)
                    list(stream)
                out[f"{name}_ms_p50"] = statistics.median(times)
            return {"gap_ms": gap_ms, **out}
    finally:
        for p in servers:
            p.terminate()


def _tcp_echo(port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)


def grpc_hops(port: int, gap_ms: float, n: int) -> dict:
    async def main() -> dict:
        channel = grpc_util.insecure_channel(f"127.0.0.1:{port}")
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        request = prefill_pb2.PrefillRequest(
            request_id="r" * 41, prompt_token_ids=list(range(1000, 1064)),
            params=types_pb2.SamplingParams(max_tokens=32, temperature=0.0))
        first, whole = [], []
        for i in range(n + 10):
            await asyncio.sleep(gap_ms / 1e3)
            t = time.perf_counter()
            got = None
            async for _ in stub.Prefill(request, timeout=30):
                got = got or time.perf_counter()
            if i >= 10:  # the first calls set up the connection
                first.append((got - t) * 1e3)
                whole.append((time.perf_counter() - t) * 1e3)
        await channel.close()
        return {"first_message_ms_p50": statistics.median(first),
                "call_ms_p50": statistics.median(whole)}

    return asyncio.run(main())


def tcp_round_trips(sock: socket.socket, gap_ms: float, n: int) -> float:
    times = []
    for _ in range(n):
        time.sleep(gap_ms / 1e3)
        t = time.perf_counter()
        sock.sendall(b"x")
        sock.recv(64)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="timed calls per gap")
    ap.add_argument("--out", type=Path, default=Path("out/grpc_floor.json"))
    args = ap.parse_args()
    grpc_port, tcp_port = free_port(), free_port()
    servers = [mp.Process(target=_grpc_server, args=(grpc_port,), daemon=True),
               mp.Process(target=_tcp_echo, args=(tcp_port,), daemon=True)]
    for p in servers:
        p.start()
    time.sleep(1.5)
    sock = socket.create_connection(("127.0.0.1", tcp_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rows = []
    try:
        two = two_hop_floor(50, args.calls)
        print(f"two hops (client -> relay -> server), first message: hot {two['hot_ms_p50']:.3f} "
              f"ms, after 50 ms idle {two['after_idle_ms_p50']:.3f} ms", flush=True)
        for gap in GAPS_MS:
            row = {"gap_ms": gap, **grpc_hops(grpc_port, gap, args.calls),
                   "tcp_round_trip_ms_p50": tcp_round_trips(sock, gap, args.calls)}
            rows.append(row)
            print(f"idle {gap:>3} ms: gRPC first message {row['first_message_ms_p50']:.3f} ms, "
                  f"whole call {row['call_ms_p50']:.3f} ms; TCP round trip "
                  f"{row['tcp_round_trip_ms_p50'] * 1e3:.0f} us", flush=True)
    finally:
        sock.close()
        for p in servers:
            p.terminate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "two_hops": two, "cpus": mp.cpu_count()},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

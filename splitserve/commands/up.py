"""`splitserve up`: the whole stack on this machine, each service its own process on loopback.

Starts a private Redis (unless --registry-url), converts the model once (so the services do not
all convert it at the same time), starts the prefill and decode services and the gateway, waits
until the gateway sees every instance, prints how to send a first request, then supervises the
services until Ctrl-C or SIGTERM.

Supervision (--on-service-exit, splitserve.launch.Supervisor):

- restart (the default, like compose's `restart: unless-stopped`): a prefill or decode service
  that exits is logged (one line on stderr:
  `service exited: role=decode name=decode-1 pid=... exit=SIGKILL restart=1 in_s=1`) and started
  again with the same argv after a backoff (--restart-backoff-s, doubling up to
  --restart-max-backoff-s); it registers under a new instance id, and the gateway's migration
  and retries carry its requests to the others meanwhile. The gateway is restarted the same way,
  on its port: the streams it carried end with it (clients see UNAVAILABLE and may retry), but
  stopping the stack would lose the same streams and serve nothing after. The private
  redis-server is restarted at once on its port: the services re-register on their next
  heartbeat (docs/RELIABILITY.md, "Redis restart"); if it cannot start again the stack stops.
  A service that exits more than --max-restarts times within --restart-window-s is a crash
  loop: everything stops, exit status 1.
- stop: the first service that exits stops the stack (exit status 1).

A service that exits before the stack is up stops it in both modes (a bad flag, a missing model:
a restart would fail the same way). Ctrl-C and SIGTERM stop everything and restart nothing: the
services get SIGTERM (SIGKILL after 15 s), then the redis-server stops; a child started by a
restart the signal cut short is ended too.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from common.engine.config import EngineConfig
from common.flags import leaf, to_argv
from common.serving.auth import AuthConfig
from common.serving.tls import TlsConfig
from gateway.config import GatewayConfig
from splitserve.commands.service import tensor_parallel_refusal
from splitserve.launch import RestartBudget, RestartPolicy, Supervisor, service_argv

if TYPE_CHECKING:
    from common.registry import EmbeddedRedis

START_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stack")
    g.add_argument("--grpc-port", type=int, default=leaf(GatewayConfig, "grpc_port").default,
                   help="gateway's public gRPC port")
    g.add_argument("--http-port", type=int, default=leaf(GatewayConfig, "http_port").default,
                   help="gateway's OpenAI-compatible HTTP port (0 = off)")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics: the gateway on this port, then the prefill and "
                        "the decode services on the ports after it, in order (0 = off)")
    g.add_argument("--registry-url", default=None,
                   help="Redis URL of an external registry; unset: start a private redis-server")
    g.add_argument("--registry-namespace", default=leaf(GatewayConfig, "registry_namespace").default,
                   help="key prefix of this stack in the registry")
    g.add_argument("--num-prefill", type=int, default=1, help="prefill services to start")
    g.add_argument("--num-decode", type=int, default=1, help="decode services to start")
    g.add_argument("--host", default=leaf(GatewayConfig, "host").default,
                   help="address every service listens on")
    g.add_argument("--otlp-endpoint", default=leaf(GatewayConfig, "otlp_endpoint").default,
                   help=leaf(GatewayConfig, "otlp_endpoint").help + "; passed to every "
                        "service")
    s = parser.add_argument_group("supervision")
    s.add_argument("--on-service-exit", choices=("restart", "stop"), default="restart",
                   help="a service that exits: start it again (after a backoff), or stop the "
                        "whole stack")
    s.add_argument("--restart-backoff-s", type=float, default=RestartPolicy.backoff_s,
                   help="pause before a service's first restart; doubles with each restart "
                        "within --restart-window-s")
    s.add_argument("--restart-max-backoff-s", type=float, default=RestartPolicy.max_backoff_s,
                   help="the longest pause before a restart")
    s.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                   help="restarts of one service within --restart-window-s; one exit more "
                        "is a crash loop and stops the stack")
    s.add_argument("--restart-window-s", type=float, default=RestartPolicy.window_s,
                   help="the window (seconds) over which --max-restarts counts a service's exits")
    EngineConfig.add_cli_args(parser)  # passed on to the prefill and decode services
    # Every service gets the TLS flags; the gateway's public port never asks for a client
    # certificate (the API key, passed to the gateway only, authenticates clients).
    TlsConfig.add_cli_args(parser)
    AuthConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    if args.num_prefill < 1 or args.num_decode < 1:
        print("--num-prefill and --num-decode must be at least 1", file=sys.stderr)
        return 2
    try:
        policy = RestartPolicy(args.restart_backoff_s, args.restart_max_backoff_s,
                               args.max_restarts, args.restart_window_s)
    except ValueError as e:
        print(f"restart policy: {e}", file=sys.stderr)
        return 2
    engine = EngineConfig.from_cli_args(args)
    refusal = tensor_parallel_refusal(engine)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    tls, auth = TlsConfig.from_cli_args(args), AuthConfig.from_cli_args(args)
    redis = None
    if args.registry_url is None:
        from common.registry import EmbeddedRedis
        redis = EmbeddedRedis()
        args.registry_url = redis.url
        print(f"registry: private redis-server at {redis.url}")
    model = engine.model
    if not model.is_dummy:
        from common.models.loader import resolve_model
        print(f"model: {model.name} -> {resolve_model(model.name, model.model_cache_dir)}")
    common = {"registry_url": args.registry_url, "namespace": args.registry_namespace,
              "host": args.host, "model": engine.model.name}
    if engine.model.cpu_threads == 0 and not engine.model.device.startswith("cuda"):
        # Services on one machine share its cores: give each its share (OpenMP threads that
        # outnumber the cores spin against each other and slow every service down).
        share = max(1, (os.cpu_count() or 1) // (args.num_prefill + args.num_decode))
        engine = dataclasses.replace(engine, model=dataclasses.replace(model, cpu_threads=share))
    tracing = ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    engine_flags = [*to_argv(engine, skip=("model",)), *tls.to_argv(), *tracing]
    # The prefill side never speculates (it samples one token), so it gets no draft model.
    prefill_flags = [*to_argv(engine, skip=("model",), skip_groups=("speculative",)),
                     *tls.to_argv(), *tracing]
    gateway_flags = ["--model-cache-dir", engine.model.model_cache_dir,
                     *dataclasses.replace(tls, tls_client_auth=False).to_argv(),
                     *to_argv(auth), *tracing]
    if engine.model.served_model_name:
        gateway_flags += ["--served-model-name", engine.model.served_model_name]
    last_port = args.metrics_port + args.num_prefill + args.num_decode
    metrics_ports = iter(range(args.metrics_port, last_port + 1) if args.metrics_port else ())
    supervisor = Supervisor(policy if args.on_service_exit == "restart" else None)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        gateway_metrics = next(metrics_ports, 0)
        for role, n, flags in (("prefill", args.num_prefill, prefill_flags),
                               ("decode", args.num_decode, engine_flags)):
            for i in range(n):
                supervisor.start(f"{role}-{i}", service_argv(
                    role, **common, extra=flags, metrics_port=next(metrics_ports, 0)))
        supervisor.start("gateway", service_argv(
            "gateway", port=args.grpc_port, **common, metrics_port=gateway_metrics,
            http_port=args.http_port, extra=gateway_flags))
        address = f"{args.host}:{args.grpc_port}"
        _wait_ready(address, args.num_prefill, args.num_decode, supervisor.procs, tls,
                    auth.client_key())
        http = (f"OpenAI-compatible API at http://{args.host}:{args.http_port}/v1; "
                if args.http_port else "")
        metrics = (f"/metrics on ports {args.metrics_port}-{last_port} (gateway, prefill, "
                   "decode); " if args.metrics_port else "")
        print(f"\nsplitserve is up: gateway {address}, {args.num_prefill} prefill, "
              f"{args.num_decode} decode; {http}{metrics}send a first request with\n\n"
              f"    splitserve generate --gateway {address} \"Write a haiku about the sea.\"\n\n"
              "Ctrl-C stops everything.", flush=True)
        reason = None
        while reason is None:
            time.sleep(0.2)
            reason = supervisor.poll()
            if reason is None and redis is not None and not _alive(redis.pid):
                redis, reason = _restart_redis(redis, supervisor.budget)
        print(f"{reason}; stopping the stack", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as e:
        print(f"{e}; stopping the stack", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping the stack", file=sys.stderr)
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut this short
            signal.signal(sig, signal.SIG_IGN)
        supervisor.stop()
        if redis is not None:
            redis.stop()
        _end_leftover_children()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _alive(pid: int | None) -> bool:
    import psutil
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _restart_redis(redis: EmbeddedRedis, budget: RestartBudget | None,
                   ) -> tuple[EmbeddedRedis | None, str | None]:
    """The private redis-server died: a new one on its port, or (None, why the stack stops)."""
    from common.registry import EmbeddedRedis
    pid, port = redis.pid, redis.port
    redis.stop()
    verdict = None if budget is None else budget.on_exit("redis", time.monotonic())
    print(f"service exited: role=redis name=redis pid={pid} "
          f"restart={'none' if verdict is None else verdict[0]}", file=sys.stderr, flush=True)
    if verdict is None:
        return None, f"the private redis-server (pid {pid}) exited" + (
            "" if budget is None else " too often (crash loop)")
    try:
        redis = EmbeddedRedis(port=port)
    except RuntimeError as e:
        return None, f"the private redis-server exited and did not start again: {e}"
    print(f"service restarted: name=redis pid={redis.pid} restart={verdict[0]}",
          file=sys.stderr, flush=True)
    return redis, None


def _end_leftover_children() -> None:
    """A child that a signal caught between fork and Popen's return has no Popen to stop it."""
    import psutil
    left = psutil.Process().children()
    for p in left:
        p.terminate()
    for p in psutil.wait_procs(left, timeout=5.0)[1]:
        p.kill()


def _wait_ready(address: str, num_prefill: int, num_decode: int,
                procs: list[subprocess.Popen], tls: TlsConfig, api_key: str | None) -> None:
    """Until the gateway answers ModelInfo listing every instance."""
    import grpc

    from common.serving.auth import bearer_metadata
    from common.serving.tls import sync_channel
    from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc
    deadline = time.monotonic() + START_TIMEOUT_S
    with sync_channel(address, tls) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a service exited during start-up")
            try:
                info = stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=1.0,
                                      metadata=bearer_metadata(api_key))
                if (info.num_prefill_instances >= num_prefill
                        and info.num_decode_instances >= num_decode):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"the stack did not come up within {START_TIMEOUT_S:.0f} s")

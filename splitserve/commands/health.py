"""`splitserve health`: probe a service's readiness, the standard gRPC health check of ADDRESS
(or, with --http, an HTTP /health URL); exits 0 when it says SERVING (HTTP 200), else 1, printing
one line either way. Imports no torch: a container's health check can run it."""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.serving.tls import TlsConfig, sync_channel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051",
                        help="gRPC address host:port to health-check (ignored with --http)")
    parser.add_argument("--service", default="",
                        help="service to ask about, e.g. splitserve.v1.GenerationService ('' = the "
                             "whole server)")
    parser.add_argument("--http", default=None, metavar="URL",
                        help="probe this HTTP URL instead (e.g. http://127.0.0.1:8000/health)")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="probe deadline")
    TlsConfig.add_cli_args(parser)  # --tls-ca: probe a server that serves TLS


def check_grpc(address: str, service: str, timeout_s: float, tls: TlsConfig) -> tuple[bool, str]:
    with sync_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    return (reply.status == health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"{reply.status} {reply.read().decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return False, f"{e.code} {e.read().decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"unreachable: {e}"


def run(args: argparse.Namespace) -> int:
    if args.http:
        ok, what = check_http(args.http, args.timeout_s)
        target = args.http
    else:
        ok, what = check_grpc(args.address, args.service, args.timeout_s,
                              TlsConfig.from_cli_args(args))
        target = args.address + (f" ({args.service})" if args.service else "")
    print(f"{target}: {what.strip()}")
    return 0 if ok else 1

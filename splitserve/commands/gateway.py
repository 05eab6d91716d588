"""`splitserve gateway`: the public gRPC API (imports no torch; starts in about a second)."""

from __future__ import annotations

import argparse
import asyncio

from common.serving.auth import AuthConfig
from common.serving.tls import TlsConfig
from gateway.config import GatewayConfig
from splitserve.commands.logs import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    GatewayConfig.add_cli_args(parser)
    TlsConfig.add_cli_args(parser)
    AuthConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    setup_logging("gateway")
    from gateway.server import serve
    asyncio.run(serve(GatewayConfig.from_cli_args(args), TlsConfig.from_cli_args(args),
                      AuthConfig.from_cli_args(args)))
    return 0

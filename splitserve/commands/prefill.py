"""`splitserve prefill`: one prefill service (engine flags plus the service's own)."""

from __future__ import annotations

import argparse
import asyncio

from common.config import EngineConfig
from common.dataclass_cli import add_dataclass_args, from_dataclass_args
from common.tls import TlsConfig
from prefill_service.config import PrefillConfig
from splitserve.commands.logs import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(PrefillConfig, parser, "prefill service")
    EngineConfig.add_cli_args(parser)
    TlsConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    setup_logging("prefill")
    from prefill_service.server import serve
    asyncio.run(serve(from_dataclass_args(PrefillConfig, args), EngineConfig.from_cli_args(args),
                      TlsConfig.from_cli_args(args)))
    return 0

"""`splitserve decode`: one decode service (engine flags plus the service's own)."""

from __future__ import annotations

import argparse

from decode_service.config import DecodeServiceConfig
from splitserve.commands.logs import setup_logging
from splitserve.commands.service import add_service_arguments, run_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, DecodeServiceConfig, "decode service")


def run(args: argparse.Namespace) -> int:
    setup_logging("decode", args.log_level.upper())
    from decode_service.server import serve  # imports torch and the engine: after logging
    return run_service(serve, DecodeServiceConfig, args)

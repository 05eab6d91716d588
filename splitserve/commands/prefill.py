"""`splitserve prefill`: one prefill service (engine flags plus the service's own)."""

from __future__ import annotations

import argparse

from prefill_service.config import PrefillServiceConfig
from splitserve.commands.logs import setup_logging
from splitserve.commands.service import add_service_arguments, run_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, PrefillServiceConfig, "prefill service")


def run(args: argparse.Namespace) -> int:
    setup_logging("prefill", args.log_level.upper())
    from prefill_service.server import serve  # imports torch and the engine: after logging
    return run_service(serve, PrefillServiceConfig, args)

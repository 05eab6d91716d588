"""What `splitserve prefill` and `splitserve decode` share: a model service's flags (its own
config's, the engine's, TLS) and running it until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from common.engine.config import EngineConfig
from common.flags import add_args, from_args
from common.serving.tls import TlsConfig

C = TypeVar("C")  # the service's config dataclass (PrefillServiceConfig, DecodeServiceConfig)

Serve = Callable[[C, EngineConfig, TlsConfig], Coroutine[Any, Any, None]]


def add_service_arguments(parser: argparse.ArgumentParser, config_cls: type[C],
                          title: str) -> None:
    """The service's own flags (under `title`), then the engine's, then TLS."""
    add_args(config_cls, parser, title)
    EngineConfig.add_cli_args(parser)
    TlsConfig.add_cli_args(parser)
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"),
                        help="log records at this level and above (debug adds per-handoff "
                             "timings)")


def run_service(serve: Serve[C], config_cls: type[C], args: argparse.Namespace) -> int:
    """serve(config, engine config, TLS) from the flags, until the service stops."""
    asyncio.run(serve(from_args(config_cls, args), EngineConfig.from_cli_args(args),
                      TlsConfig.from_cli_args(args)))
    return 0

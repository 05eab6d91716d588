"""What `splitserve prefill` and `splitserve decode` share: a model service's flags (its own
config's, the engine's, TLS) and running it until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import sys
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


def tensor_parallel_refusal(engine: EngineConfig) -> str | None:
    """Why a prefill or decode service cannot run at this tensor parallel size (None: it can).

    The KV handoff moves one pool's blocks ([layers, 2, blocks, block_size, all KV heads,
    head_dim]); at TP N each rank's pool holds only its KV heads, so a handoff would carry
    rank 0's heads alone. Until it carries every rank's shard, services run at TP 1."""
    n = engine.parallel.tensor_parallel_size
    if n == 1:
        return None
    return (f"--tensor-parallel-size {n}: prefill and decode services run at tensor parallel "
            "size 1 for now (the KV handoff carries one rank's KV heads, not each rank's "
            "shard); run-batch serves a model at any size")


def run_service(serve: Serve[C], config_cls: type[C], args: argparse.Namespace) -> int:
    """serve(config, engine config, TLS) from the flags, until the service stops."""
    engine = EngineConfig.from_cli_args(args)
    refusal = tensor_parallel_refusal(engine)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    asyncio.run(serve(from_args(config_cls, args), engine, TlsConfig.from_cli_args(args)))
    return 0

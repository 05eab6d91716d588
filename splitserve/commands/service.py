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

    At TP N the handoff moves each rank's shard rank to rank (common/engine/rank_kv.py), the
    ranks above 0 reaching their peers' pools through /dev/shm files: CPU pools only. A GPU
    pool per rank would need a cuda_ipc (or grpc) offer per rank, which is not built."""
    n = engine.parallel.tensor_parallel_size
    if n == 1 or engine.model.device == "cpu" or (
            engine.model.device == "auto" and not _cuda_available()):
        return None
    return (f"--tensor-parallel-size {n} on device {engine.model.device!r}: prefill and decode "
            "services run tensor parallel on CPU ranks only for now (the handoff reaches the "
            "other ranks' pools through /dev/shm); run-batch serves a model at any size on "
            "any device")


def _cuda_available() -> bool:
    import torch  # the services import it anyway; the gateway never comes here
    return torch.cuda.is_available()


def run_service(serve: Serve[C], config_cls: type[C], args: argparse.Namespace) -> int:
    """serve(config, engine config, TLS) from the flags, until the service stops."""
    engine = EngineConfig.from_cli_args(args)
    refusal = tensor_parallel_refusal(engine)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    asyncio.run(serve(from_args(config_cls, args), engine, TlsConfig.from_cli_args(args)))
    return 0

"""Whether the gateway can serve a request now: it needs at least one prefill and one decode
instance that are registered (their heartbeat keeps the record alive) and not in quarantine (their
last call failed and they did not answer a health check). Local prefill (--local-prefill-max-tokens)
covers only short prompts, so a prefill instance is needed all the same.

`missing_kinds` is the rule, pure Python over the instance lists; `Readiness` applies it to the
gateway's view (gateway/instances.py) after every read of the registry (the discovery round's, or
one a request triggered) and every half discovery interval (a quarantine runs out without a read),
and sets the gRPC health of the server ("") and of splitserve.v1.GenerationService to match; the HTTP
/health answers from `report()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from common.registry import InstanceInfo
from gateway.instances import KINDS

if TYPE_CHECKING:
    from common.serving.grpc_util import GrpcServer
    from gateway.instances import Instances

log = logging.getLogger("splitserve.gateway.readiness")


def missing_kinds(usable: Mapping[str, Sequence[InstanceInfo]]) -> list[str]:
    """The instance kinds of which no usable instance is left, in KINDS order (empty: ready)."""
    return [kind for kind in KINDS if not usable.get(kind)]


class Readiness:
    """The gateway's readiness, recomputed from its instance view on each of its reads and every
    half discovery interval; /health and gRPC health both answer from the last computation, so
    they never disagree."""

    def __init__(self, instances: Instances, server: GrpcServer):
        self.instances = instances
        self.server = server
        self._report = self.compute()
        self.ready: bool | None = None  # what gRPC health says; None until the first update
        instances.on_refresh.append(self.update)

    def compute(self) -> dict:
        """The body of /health: status, the kinds missing, the usable instances per kind."""
        usable = {kind: self.instances.usable(kind) for kind in KINDS}
        missing = missing_kinds(usable)
        return {"status": "not ready" if missing else "ready", "missing": missing,
                "instances": {kind: len(usable[kind]) for kind in KINDS}}

    def report(self) -> dict:
        return self._report

    async def update(self) -> bool:
        report = self.compute()
        ready = not report["missing"]
        if ready != self.ready:
            await self.server.set_serving(ready)
            log.info("gateway %s", "ready" if ready
                     else f"not ready (missing {', '.join(report['missing'])})")
            self.ready = ready
        self._report = report
        return ready

    async def run(self) -> None:
        """Follow the instance view; runs until cancelled."""
        while True:
            try:
                await self.update()
            except Exception:
                log.exception("updating the gateway's health status failed")
            await asyncio.sleep(self.instances.interval_s / 2)

"""Log format shared by the service commands: one line per record, tagged with the service."""

from __future__ import annotations

import logging


def setup_logging(service: str, level: int | str = logging.INFO) -> None:
    """`level` applies to splitserve's own loggers; other libraries log at INFO and above."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("splitserve").setLevel(level)

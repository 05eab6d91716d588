"""Log format shared by the service commands: one line per record, tagged with the service."""

from __future__ import annotations

import logging


def setup_logging(service: str, level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level, format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

"""The decode service's settings (beside the engine's EngineConfig); every field is a flag."""

from __future__ import annotations

from dataclasses import dataclass

from common.instance import InstanceConfig


@dataclass(frozen=True, slots=True)
class DecodeConfig(InstanceConfig):
    pull_timeout_s: float = 30.0

    HELP = {
        **InstanceConfig.HELP,
        "pull_timeout_s": "longest a KV pull from a prefill service may take",
    }

    def __post_init__(self) -> None:
        InstanceConfig.__post_init__(self)
        if self.pull_timeout_s <= 0:
            raise ValueError("--pull-timeout-s must be positive")

"""The decode service's settings (beside the engine's EngineConfig); every field is a flag."""

from __future__ import annotations

from dataclasses import dataclass

from common.flags import opt
from common.serving.instance import InstanceConfig


@dataclass(frozen=True, slots=True)
class DecodeServiceConfig(InstanceConfig):
    pull_timeout_s: float = opt(30.0, "longest a KV pull from a prefill service may take")
    lease_renew_s: float = opt(10.0, "while pulling a handoff, its lease is set to this long "
                               "every third of it, so a long pull outlives the prefill side's "
                               "lease")

    def __post_init__(self) -> None:
        InstanceConfig.__post_init__(self)
        if self.pull_timeout_s <= 0 or self.lease_renew_s <= 0:
            raise ValueError("--pull-timeout-s and --lease-renew-s must be positive")

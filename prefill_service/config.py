"""The prefill service's settings (beside the engine's EngineConfig); every field is a flag."""

from __future__ import annotations

from dataclasses import dataclass

from common.serving.instance import InstanceConfig


@dataclass(frozen=True, slots=True)
class PrefillConfig(InstanceConfig):
    handoff_lease_s: float = 10.0
    reap_interval_s: float = 0.02
    prefix_sync_interval_s: float = 1.0

    HELP = {
        **InstanceConfig.HELP,
        "handoff_lease_s": "how long a published handoff waits for a decode service to confirm "
                           "before its blocks are released",
        "reap_interval_s": "how often held handoffs are checked for confirmation or expiry",
        "prefix_sync_interval_s": "how often evictions from the prefix cache are published to "
                                  "the registry's prefix index",
    }

    def __post_init__(self) -> None:
        InstanceConfig.__post_init__(self)
        if self.handoff_lease_s <= 0 or self.reap_interval_s <= 0:
            raise ValueError("--handoff-lease-s and --reap-interval-s must be positive")
        if self.prefix_sync_interval_s <= 0:
            raise ValueError("--prefix-sync-interval-s must be positive")

"""The prefill service's settings (beside the engine's EngineConfig); every field is a flag."""

from __future__ import annotations

from dataclasses import dataclass

from common.flags import opt
from common.serving.instance import InstanceConfig


@dataclass(frozen=True, slots=True)
class PrefillServiceConfig(InstanceConfig):
    handoff_lease_s: float = opt(10.0, "the deadline of a KV delivery to a decode service: its "
                                 "blocks are released when it ends, at the latest then")
    prefix_sync_interval_s: float = opt(1.0, "how often evictions from the prefix cache are "
                                        "published to the registry's prefix index")
    express: bool = opt(True, "open an express socket, a Unix datagram socket through which "
                        "gateways on this host start prompts without waiting for the Prefill "
                        "call's gRPC hop and get the first token back the same way "
                        "(common/serving/express.py); never with TLS")
    early_handoff: bool = opt(True, "on a GPU, ring the decode service's doorbell (on this "
                              "host) when a prompt's last step is launched, with an "
                              "interprocess event behind its forward, so that the decode's "
                              "copy of the KV runs the moment the step ends rather than after "
                              "the first token is read (decode_service/handoff.py)")

    def __post_init__(self) -> None:
        InstanceConfig.__post_init__(self)
        if self.handoff_lease_s <= 0:
            raise ValueError("--handoff-lease-s must be positive")
        if self.prefix_sync_interval_s <= 0:
            raise ValueError("--prefix-sync-interval-s must be positive")

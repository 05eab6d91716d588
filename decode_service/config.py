"""The decode service's settings (beside the engine's EngineConfig); every field is a flag."""

from __future__ import annotations

from dataclasses import dataclass

from common.flags import opt
from common.serving.instance import InstanceConfig


@dataclass(frozen=True, slots=True)
class DecodeServiceConfig(InstanceConfig):
    pull_timeout_s: float = opt(30.0, "longest a KV pull from a prefill service may take")
    deliver_wait_s: float = opt(5.0, "how long a prefill service's delivery waits for the "
                                "request's Decode call to arrive (the gateway sends both at once)")
    doorbell: bool = opt(True, "open a delivery doorbell, a Unix datagram socket through which "
                         "prefill services on this host start the KV pull without waiting for "
                         "a gRPC hop (common/serving/doorbell.py); never with TLS")
    express: bool = opt(True, "send a stream's first message also as a Unix datagram to the "
                        "gateway's express reply socket when the gateway is on this host and "
                        "names one, from the engine's thread (common/serving/express.py); never "
                        "with TLS")
    early_copy_on_device: bool = opt(True, "on a GPU, queue an early handoff's copy at once on "
                                     "a stream that waits on the device for the prefill's step "
                                     "(else a thread waits for it on the host, then queues the "
                                     "copy)")
    admit_wait_ms: float = opt(2.0, "on a GPU, after admitting a handed-off request to an idle "
                               "engine, the event loop waits up to this long for the engine's "
                               "launch of its first step, leaving the engine's thread the GIL "
                               "(token 2's critical path); 0 never waits")
    peer_check_s: float = opt(1.0, "while a request waits for its KV, how often the prefill "
                              "instance's registry record is checked; when it is gone the "
                              "reserved blocks are freed")

    def __post_init__(self) -> None:
        InstanceConfig.__post_init__(self)
        if self.admit_wait_ms < 0:
            raise ValueError("--admit-wait-ms must be >= 0")
        if min(self.pull_timeout_s, self.deliver_wait_s, self.peer_check_s) <= 0:
            raise ValueError("--pull-timeout-s, --deliver-wait-s and --peer-check-s must be "
                             "positive")

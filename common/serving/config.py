"""Settings every server shares (the gateway, prefill and decode services), as config groups of
`common.flags`: where it listens, which registry it meets the others in, its latency objectives.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from common.flags import opt
from common.serving.metrics import SLO


def _port_ok(port: int) -> bool:
    return 0 <= port < 65536


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address the gRPC server listens on (0.0.0.0 for every "
                    "interface)")
    metrics_port: int = opt(0, "port of Prometheus /metrics (0 = off)")
    shutdown_grace_s: float = opt(5.0, "on SIGTERM, how long in-flight requests may finish")
    otlp_endpoint: str = opt("", "OpenTelemetry: export traces over OTLP/gRPC to this host:port "
                             "(e.g. a collector at localhost:4317); empty = tracing off")
    gil_switch_interval_ms: float = opt(
        0.5, "how long a thread may hold the GIL while another waits for it (Python's "
        "sys.setswitchinterval; its default is 5 ms): a service's engine thread that waited on "
        "the device or a socket waits at most this long for the event loop's thread to let go")

    def __post_init__(self) -> None:
        if not _port_ok(self.metrics_port):
            raise ValueError(f"--metrics-port out of range: {self.metrics_port}")
        if self.shutdown_grace_s < 0:
            raise ValueError("--shutdown-grace-s must be >= 0")
        if self.gil_switch_interval_ms <= 0:
            raise ValueError("--gil-switch-interval-ms must be positive")

    def apply(self) -> None:
        """Process-wide settings, at the server's start."""
        sys.setswitchinterval(self.gil_switch_interval_ms / 1000)


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    url: str = opt("redis://127.0.0.1:6379/0", "Redis URL of the registry (service discovery and "
                   "the prefix index)", flag="registry_url")
    namespace: str = opt("splitserve", "key prefix shared by every service of one stack",
                         flag="registry_namespace")


@dataclass(frozen=True, slots=True)
class SLOConfig:
    ttft_ms: float = opt(0.0, "goodput: time-to-first-token objective in ms (0 = none)",
                         flag="slo_ttft_ms")
    tpot_ms: float = opt(0.0, "goodput: time-per-output-token objective in ms (0 = none)",
                         flag="slo_tpot_ms")

    def __post_init__(self) -> None:
        if self.ttft_ms < 0 or self.tpot_ms < 0:
            raise ValueError("SLOs must be >= 0 (0 = none)")

    @property
    def objective(self) -> SLO:
        """In seconds, as the metrics count goodput."""
        return SLO(self.ttft_ms / 1000, self.tpot_ms / 1000)

"""The gateway's config: its own settings, the shared server/registry/SLO groups, and the router's
and migration's groups; every field is a CLI flag (`splitserve gateway --help`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.engine.config import DEFAULT_CACHE_DIR, DEFAULT_MODEL, served_model_name
from common.flags import add_args, from_args, group, opt
from common.serving.config import RegistryConfig, ServerConfig, SLOConfig


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How prefill instances are scored (gateway/router.py)."""
    prefix_token_weight: float = opt(1.0, "prefill routing: score per prompt token found in an "
                                     "instance's prefix cache")
    queued_request_cost_tokens: int = opt(256, "prefill routing: score cost of each request "
                                          "queued on an instance, in tokens")

    def __post_init__(self) -> None:
        if self.prefix_token_weight < 0:
            raise ValueError("--prefix-token-weight must be >= 0")
        if self.queued_request_cost_tokens < 0:
            raise ValueError("--queued-request-cost-tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    """How a request survives a failed service (gateway/migration.py)."""
    max_retries: int = opt(3, "failures of a prefill or decode service one request survives: it "
                           "is retried, or resumed elsewhere with the tokens generated so far")
    retry_wait_s: float = opt(3.0, "after a failure, how long to wait for a usable instance (or "
                              "the registry) before answering UNAVAILABLE")

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.retry_wait_s < 0:
            raise ValueError("--max-retries and --retry-wait-s must be >= 0")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    server: ServerConfig = group(ServerConfig, "server")
    grpc_port: int = opt(50051, "port of the public gRPC API (0 picks a free one)")
    http_port: int = opt(0, "port of the OpenAI-compatible HTTP API, which also serves /metrics "
                         "(0 = off)")
    registry: RegistryConfig = group(RegistryConfig)
    slo: SLOConfig = group(SLOConfig, "SLO")
    model: str = opt(DEFAULT_MODEL, "model spec; the gateway only reads its tokenizer and config")
    served_model_name: str | None = opt(None, "name clients use for the model; unset: derived "
                                        "from --model")
    model_cache_dir: str = opt(str(DEFAULT_CACHE_DIR),
                               "where converted (GGUF -> safetensors) models are cached")
    tokenizer: str | None = opt(None, "model directory to read the tokenizer and config.json "
                                "from; unset: --model's, converted by a prefill or decode service")
    model_wait_s: float = opt(600.0, "how long to wait at start-up for a service to convert the "
                              "model")
    max_inflight: int = opt(256, "requests served at once; more get RESOURCE_EXHAUSTED")
    request_timeout_s: float = opt(600.0, "deadline for requests whose client set none")
    local_prefill_max_tokens: int = opt(0, "prompts this short are prefilled on the decode "
                                        "service (no handoff); 0 = always use a prefill service")
    discovery_interval_s: float = opt(0.25, "how often the instance list is re-read from the "
                                      "registry")
    quarantine_s: float = opt(5.0, "how long an instance whose call failed and that fails a "
                              "health check gets no requests")
    resume_retention_s: float = opt(30.0, "a resumable request keeps running this long without a "
                                    "client, and its output is kept this long after it ends")
    max_n: int = opt(16, "most choices one request may ask for (n); more is INVALID_ARGUMENT")
    express: bool = opt(True, "start prompts on prefill services of this host with a Unix "
                        "datagram ahead of the Prefill call, and take the first token back "
                        "the same way (common/serving/express.py); never with TLS")
    router: RouterConfig = group(RouterConfig, "routing")
    migration: MigrationPolicy = group(MigrationPolicy, "migration")

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.grpc_port < 65536, f"--grpc-port out of range: {self.grpc_port}"),
            (0 <= self.http_port < 65536, f"--http-port out of range: {self.http_port}"),
            (self.max_inflight >= 1, "--max-inflight must be at least 1"),
            (self.request_timeout_s > 0, "--request-timeout-s must be positive"),
            (self.local_prefill_max_tokens >= 0, "--local-prefill-max-tokens must be >= 0"),
            (self.discovery_interval_s > 0, "--discovery-interval-s must be positive"),
            (self.quarantine_s >= 0, "--quarantine-s must be >= 0"),
            (self.resume_retention_s > 0, "--resume-retention-s must be positive"),
            (self.max_n >= 1, "--max-n must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        return served_model_name(self.model, self.served_model_name)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_args(cls, parser, "gateway")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return from_args(cls, args)

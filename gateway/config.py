"""The gateway's one frozen config; every field is a CLI flag (`splitserve gateway --help`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.engine.config import DEFAULT_CACHE_DIR
from common.serving.dataclass_cli import add_dataclass_args, from_dataclass_args


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 0
    metrics_port: int = 0
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    registry_url: str = "redis://127.0.0.1:6379/0"
    registry_namespace: str = "splitserve"
    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None
    model_cache_dir: str = str(DEFAULT_CACHE_DIR)
    tokenizer: str | None = None
    model_wait_s: float = 600.0
    max_inflight: int = 256
    request_timeout_s: float = 600.0
    local_prefill_max_tokens: int = 0
    prefix_token_weight: float = 1.0
    queued_request_cost_tokens: int = 256
    discovery_interval_s: float = 0.25
    shutdown_grace_s: float = 5.0
    max_retries: int = 3
    retry_wait_s: float = 3.0
    quarantine_s: float = 5.0
    resume_retention_s: float = 30.0

    HELP = {
        "host": "address the gRPC server listens on (0.0.0.0 for every interface)",
        "grpc_port": "port of the public gRPC API (0 picks a free one)",
        "http_port": "port of the OpenAI-compatible HTTP API, which also serves /metrics "
                     "(0 = off)",
        "metrics_port": "port of Prometheus /metrics (0 = off)",
        "slo_ttft_ms": "goodput: time-to-first-token objective in ms (0 = none)",
        "slo_tpot_ms": "goodput: time-per-output-token objective in ms (0 = none)",
        "registry_url": "Redis URL of the block registry (service discovery, prefix index)",
        "registry_namespace": "key prefix shared by every service of one stack",
        "model": "model spec; the gateway only reads its tokenizer and config",
        "served_model_name": "name clients use for the model; unset: derived from --model",
        "model_cache_dir": "where converted (GGUF -> safetensors) models are cached",
        "tokenizer": "model directory to read the tokenizer and config.json from; unset: "
                     "--model's, converted by a prefill or decode service",
        "model_wait_s": "how long to wait at start-up for a service to convert the model",
        "max_inflight": "requests served at once; more get RESOURCE_EXHAUSTED",
        "request_timeout_s": "deadline for requests whose client set none",
        "local_prefill_max_tokens": "prompts this short are prefilled on the decode service "
                                    "(no handoff); 0 = always use a prefill service",
        "prefix_token_weight": "prefill routing: score per prompt token found in an "
                               "instance's prefix cache",
        "queued_request_cost_tokens": "prefill routing: score cost of each request queued on "
                                      "an instance, in tokens",
        "discovery_interval_s": "how often the instance list is re-read from the registry",
        "shutdown_grace_s": "on SIGTERM, how long in-flight requests may finish",
        "max_retries": "failures of a prefill or decode service one request survives: it is "
                       "retried, or resumed elsewhere with the tokens generated so far",
        "retry_wait_s": "after a failure, how long to wait for a usable instance (or the "
                        "registry) before answering UNAVAILABLE",
        "quarantine_s": "how long an instance whose call failed and that fails a health check "
                        "gets no requests",
        "resume_retention_s": "a resumable request keeps running this long without a client, "
                              "and its output is kept this long after it ends",
    }

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.grpc_port < 65536, f"--grpc-port out of range: {self.grpc_port}"),
            (0 <= self.http_port < 65536, f"--http-port out of range: {self.http_port}"),
            (0 <= self.metrics_port < 65536, f"--metrics-port out of range: {self.metrics_port}"),
            (self.slo_ttft_ms >= 0 and self.slo_tpot_ms >= 0, "SLOs must be >= 0 (0 = none)"),
            (self.max_inflight >= 1, "--max-inflight must be at least 1"),
            (self.request_timeout_s > 0, "--request-timeout-s must be positive"),
            (self.local_prefill_max_tokens >= 0, "--local-prefill-max-tokens must be >= 0"),
            (self.prefix_token_weight >= 0, "--prefix-token-weight must be >= 0"),
            (self.queued_request_cost_tokens >= 0, "--queued-request-cost-tokens must be >= 0"),
            (self.discovery_interval_s > 0, "--discovery-interval-s must be positive"),
            (self.shutdown_grace_s >= 0, "--shutdown-grace-s must be >= 0"),
            (self.max_retries >= 0, "--max-retries must be >= 0"),
            (self.retry_wait_s >= 0 and self.quarantine_s >= 0,
             "--retry-wait-s and --quarantine-s must be >= 0"),
            (self.resume_retention_s > 0, "--resume-retention-s must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(cls, parser, "gateway")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return from_dataclass_args(cls, args)


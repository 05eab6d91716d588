"""One streamed request against the gateway, timed piece by piece: over gRPC (GenerateStream) or
HTTP (/v1/completions with SSE). Both send token ids, greedy, ignoring EOS, so every request
generates exactly its max_tokens."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import grpc
import httpx2

from common.serving.grpc_util import insecure_channel
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from splitserve.loadgen.datasets import BenchRequest


@dataclass(slots=True)
class RequestResult:
    """Times in seconds: `start` from the run's start, the others from `start`."""
    prompt_len: int
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed pieces
    e2e: float | None = None
    output_len: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)  # type: ignore[operator]


class _Clock:
    """Feeds a RequestResult as pieces arrive."""

    def __init__(self, result: RequestResult):
        self.result = result
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def piece(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft = now - self.t0
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.result.output_len += num_tokens

    def done(self) -> None:
        self.result.e2e = time.perf_counter() - self.t0


class Backend(ABC):
    name: str

    @abstractmethod
    async def start(self) -> None:
        """Connect and check the target answers (before the clock starts)."""

    @abstractmethod
    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        """Run one request, filling `result`; errors go to result.error, never raised."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connections."""


class GrpcBackend(Backend):
    name = "grpc"

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.timeout_s = timeout_s
        self.channel: grpc.aio.Channel | None = None
        self.stub: generation_pb2_grpc.GenerationServiceStub | None = None

    async def start(self) -> None:
        self.channel = insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        await self.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10.0)

    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        assert self.stub is not None, "start() first"
        clock = _Clock(result)
        msg = generation_pb2.GenerateStreamRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=request.prompt_token_ids),
            params=types_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=0.0,
                                            ignore_eos=True))
        try:
            async for piece in self.stub.GenerateStream(msg, timeout=self.timeout_s):
                clock.piece(len(piece.token_ids))
                if piece.finish_reason:
                    result.cached_tokens = piece.usage.num_cached_tokens
            clock.done()
        except grpc.aio.AioRpcError as e:
            result.error = f"{e.code().name}: {e.details()}"

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class HttpBackend(Backend):
    name = "http"

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.client: httpx2.AsyncClient | None = None
        self.model = ""

    async def start(self) -> None:
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx2.AsyncClient(base_url=self.base_url, limits=limits,
                                         timeout=self.timeout_s)
        models = (await self.client.get("/v1/models")).raise_for_status().json()
        self.model = models["data"][0]["id"]

    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        assert self.client is not None, "start() first"
        clock = _Clock(result)
        body = {"model": self.model, "prompt": request.prompt_token_ids,
                "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    error = json.loads(await response.aread()).get("error", {})
                    result.error = f"HTTP {response.status_code}: {error.get('message')}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        result.error = chunk["error"]["message"]
                        return
                    for choice in chunk["choices"]:
                        clock.piece(len(choice.get("token_ids", ())))
                    if chunk.get("usage"):
                        details = chunk["usage"].get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens", 0)
            clock.done()
        except httpx2.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

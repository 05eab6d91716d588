"""Concurrent client load for chaos tests: greedy requests with token-id prompts, streamed through
the gateway by a few threads until stopped, each outcome recorded."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2


@dataclass(frozen=True, slots=True)
class Spec:
    request_id: str
    prompt: list[int]
    max_tokens: int

    def request(self) -> generation_pb2.GenerateStreamRequest:
        return generation_pb2.GenerateStreamRequest(
            request_id=self.request_id, prompt_token_ids=generation_pb2.TokenIds(ids=self.prompt),
            params=types_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                            ignore_eos=True))


@dataclass(slots=True)
class Outcome:
    spec: Spec
    tokens: list[int] = field(default_factory=list)
    finish_reason: int = 0
    code: grpc.StatusCode | None = None  # None: the stream ended normally
    migrations: int = 0                  # times the gateway resumed it elsewhere
    details: str = ""
    seconds: float = 0.0


class Load:
    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, *, concurrency: int, seed: int,
                 vocab_size: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int],
                 timeout_s: float):
        self.stub = stub
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self.receiving: dict[str, int] = {}  # request id -> tokens received, while streaming
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._count = 0
        self._threads = [threading.Thread(target=self._worker, name=f"load-{i}", daemon=True)
                         for i in range(concurrency)]

    def _next_spec(self) -> Spec:
        with self._lock:
            self._count += 1
            n = self.rng.randint(*self.prompt_len)
            # Ids from 3 up: 0..2 are the dummy models' special tokens.
            prompt = [self.rng.randrange(3, self.vocab_size) for _ in range(n)]
            return Spec(f"chaos-{self._count}", prompt, self.rng.randint(*self.max_tokens))

    def _worker(self) -> None:
        while not self._stop.is_set():
            self._run(self._next_spec())

    def _run(self, spec: Spec) -> None:
        out = Outcome(spec)
        start = time.monotonic()
        self.receiving[spec.request_id] = 0
        try:
            for msg in self.stub.GenerateStream(spec.request(), timeout=self.timeout_s):
                out.tokens.extend(msg.token_ids)
                self.receiving[spec.request_id] = len(out.tokens)
                if msg.finish_reason:
                    out.finish_reason = msg.finish_reason
                    out.migrations = msg.timings.num_migrations
        except grpc.RpcError as e:
            out.code, out.details = e.code(), e.details()
        out.seconds = time.monotonic() - start
        with self._lock:
            del self.receiving[spec.request_id]
            self.outcomes.append(out)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def streaming(self, min_tokens: int) -> int:
        """Streams that have received at least min_tokens tokens and are still open."""
        return sum(n >= min_tokens for n in list(self.receiving.values()))

    def stop(self, timeout_s: float) -> None:
        """No new requests; wait for those in flight."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"requests still hanging after {timeout_s} s: {alive}, "
                               f"{self.receiving}")

    def failures(self) -> Counter[str]:
        return Counter(f"{o.code.name}: {o.details}" for o in self.outcomes if o.code is not None)

"""Sends a workload to a backend: Poisson arrivals at a request rate (inf: all at once), at most
max_concurrency requests in flight, a progress bar; returns each request's timings."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time

from tqdm import tqdm

from splitserve.loadgen.backends import Backend, RequestResult
from splitserve.loadgen.datasets import BenchRequest


async def run_online(backend: Backend, requests: list[BenchRequest], request_rate: float,
                     max_concurrency: int | None, seed: int, progress: bool = True,
                     ) -> tuple[list[RequestResult], float]:
    """(results in request order, wall seconds from the first send to the last answer)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [RequestResult(len(r.prompt_token_ids)) for r in requests]
    bar = tqdm(total=len(requests), desc=backend.name, unit="req", disable=not progress,
               file=sys.stderr)
    await backend.start()
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async with limit if limit is not None else contextlib.nullcontext():
            results[i].start = time.perf_counter() - t0
            await backend.send(requests[i], results[i])
        bar.update(1)

    tasks = []
    try:
        for i in range(len(requests)):
            tasks.append(asyncio.create_task(one(i)))
            if not math.isinf(request_rate) and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
        await backend.close()

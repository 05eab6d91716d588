"""HandoffPuller: one pull-thread job claims, reserves, copies, verifies and confirms; every
failure and a cancellation leave no block reserved (real Redis, a real engine on its loop)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.flags import build
from common.kv_transport.source import KVSource
from common.registry import EmbeddedRedis, HandoffState, Registry
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import SLO, DecodeMetrics, engine_stats
from decode_service.handoff import HandoffFailed, HandoffPuller

MODEL = "dummy:tiny-llama"


@pytest.fixture(scope="module")
def registry():
    with EmbeddedRedis() as server, Registry(server.url, "puller") as registry:
        yield registry


@pytest.fixture
def setup(registry):
    engine = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", num_kv_blocks=64))
    loop = EngineLoop(engine).start()
    metrics = DecodeMetrics(engine.model_name, SLO(),
                            lambda: loop.call(engine_stats).result(timeout=5))
    puller = HandoffPuller(registry, loop, "decode-0", timeout_s=5.0, metrics=metrics)
    # The prefill side: a pool of the same geometry in this process ("local" transport).
    src = torch.randn(engine.kv_cache.shape, generator=torch.Generator().manual_seed(3))
    source = KVSource("prefill-0", src, MODEL)
    yield engine, loop, puller, source, src
    puller.close()
    loop.stop()
    source.close()
    registry.clear_instance("prefill-0")
    assert engine.block_manager.num_used_blocks == 0


def publish(registry, source, rid: str, blocks: list[int], **changes) -> None:
    desc = source.describe(rid, blocks, num_tokens=16 * len(blocks), block_hashes=[])
    registry.publish_handoff(dataclasses.replace(desc, **changes), lease_ttl_s=10)


def used(engine, loop) -> int:
    return loop.call(lambda e: e.block_manager.num_used_blocks).result(timeout=5)


def test_pull_copies_the_blocks_and_confirms(registry, setup):
    engine, loop, puller, source, src = setup
    publish(registry, source, "ok", [7, 3, 9])
    blocks = asyncio.run(puller.pull("ok"))
    assert len(blocks) == 3 and used(engine, loop) == 3
    for s, d in zip([7, 3, 9], blocks, strict=True):
        assert torch.equal(engine.kv_cache[:, :, d], src[:, :, s])
    assert registry.reap_handoffs(["ok"]) == {"ok": HandoffState.DONE}
    assert puller.transports_used == {"local": 1} and not puller.pending
    loop.call(lambda e: e.free_blocks(blocks)).result(timeout=5)


@pytest.mark.parametrize("case", ["gone", "claimed elsewhere", "checksum"])
def test_failures_free_what_they_reserved(registry, setup, case):
    engine, loop, puller, source, _ = setup
    if case == "claimed elsewhere":
        publish(registry, source, case, [1, 2])
        assert registry.claim_handoff(case, "decode-1") is not None
    elif case == "checksum":
        publish(registry, source, case, [1, 2], checksum=12345)
    with pytest.raises(HandoffFailed):
        asyncio.run(puller.pull(case))
    assert used(engine, loop) == 0 and not puller.pending
    if case == "checksum":  # not confirmed: the record stays for its lease (then the source
        assert registry.reap_handoffs([case]) == {case: HandoffState.CLAIMED}  # frees it)
    registry.cancel_handoff(case)


def test_cancelled_pull_frees_its_blocks_once_the_job_ends(registry, setup):
    engine, loop, puller, source, _ = setup
    publish(registry, source, "cancel", [4, 5, 6, 8])
    # Hold the pull thread so that the job is still to run when the caller gives up.
    gate = puller._executor.submit(lambda: asyncio.run(asyncio.sleep(0.3)))

    async def give_up() -> None:
        task = asyncio.create_task(puller.pull("cancel"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.result()
        await asyncio.sleep(0.3)  # the job ran (and confirmed); its blocks go back

    asyncio.run(give_up())
    assert used(engine, loop) == 0 and not puller.pending

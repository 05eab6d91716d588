"""Deliveries: a prompt's held blocks go to the decode service over DecodeService.Deliver and are released
when that call ends, whatever its answer, and never before it ends (a real decode servicer and
its HandoffInbox on a gRPC server in this process, two real engines, the local transport)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.flags import build
from common.kv_transport.source import KVSource
from common.registry import InstanceInfo, Registry
from common.registry.embedded import free_port
from common.serving.engine_loop import EngineLoop
from common.serving.grpc_util import GrpcServer, Service, service_name
from common.serving.metrics import SLO, DecodeMetrics, PrefillMetrics, engine_stats
from decode_service.handoff import HandoffInbox
from decode_service.servicer import DecodeServicer
from prefill_service.delivery import Deliveries
from protos.splitserve.v1 import decode_pb2, decode_pb2_grpc
from tests.prefill_service.conftest import BLOCK_SIZE, MODEL, on_engine, prompt, until

PREFILL = "prefill-0"


@pytest.fixture
def decode_side(registry: Registry):
    """A decode engine on its loop and the pieces of the decode service that take a delivery."""
    registry.register(InstanceInfo(PREFILL, "prefill", "127.0.0.1:1", MODEL), ttl_s=600)
    engine = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", block_size=BLOCK_SIZE,
                             num_kv_blocks=16))
    loop = EngineLoop(engine).start()
    metrics = DecodeMetrics(engine.model_name, SLO(),
                            lambda: loop.call(engine_stats).result(timeout=5))
    inbox = HandoffInbox(registry, loop, timeout_s=5.0, metrics=metrics, wait_s=2.0)
    yield engine, loop, inbox
    inbox.close()
    assert loop.call(lambda e: e.block_manager.num_used_blocks).result(timeout=5) == 0
    loop.stop()


async def serve_decode(inbox: HandoffInbox) -> GrpcServer:
    server = GrpcServer("127.0.0.1", 0)
    # Deliver needs only the inbox; the Decode RPC itself is not called here.
    server.add(Service(DecodeServicer(None, inbox, inbox.metrics),
                       decode_pb2_grpc.add_DecodeServiceServicer_to_server,
                       service_name(decode_pb2, "DecodeService")))
    await server.start(serving=True)
    return server


def prefill_metrics(engine: LLMEngine) -> PrefillMetrics:
    return PrefillMetrics(engine.model_name, SLO(), lambda: None)


def held(engine: LLMEngine) -> dict:
    return dict(engine.kv.held)


def test_accepted_delivery_moves_the_kv_and_releases_the_hold(engine, loop, prefill,
                                                              decode_side):
    decode_engine, decode_loop, inbox = decode_side
    out = prefill("r1", prompt(1, 40))  # 40 tokens: 3 blocks held
    source = KVSource(PREFILL, engine.kv_cache, MODEL)

    async def scenario():
        server = await serve_decode(inbox)
        deliveries = Deliveries(loop, 10.0, prefill_metrics(engine))
        try:
            take = asyncio.create_task(inbox.take("r1", 3, PREFILL))
            desc = source.describe("r1", out.held_block_ids, 40, out.block_hashes)
            accepted, reason, _ = await deliveries.deliver(desc, out.output_token_ids[0],
                                                           f"127.0.0.1:{server.port}")
            taken = await take
            await until(lambda: not held(engine))
            return accepted, reason, taken
        finally:
            await deliveries.close()
            await server.stop(0)

    accepted, reason, taken = asyncio.run(scenario())
    assert (accepted, reason, taken.first_token_id) == (True, "", out.output_token_ids[0])
    for s, d in zip(out.held_block_ids, taken.block_ids, strict=True):  # bit for bit (the
        # last block's unwritten tail is whatever the pool held, NaNs included)
        assert torch.equal(decode_engine.kv_cache[:, :, d].view(torch.int32),
                           engine.kv_cache[:, :, s].view(torch.int32))
    decode_loop.call(lambda e: e.kv.free(taken.block_ids)).result(timeout=5)
    source.close()


def test_unreachable_decode_service_releases_the_hold(engine, loop, prefill):
    out = prefill("r2", prompt(50, 20))
    source = KVSource(PREFILL, engine.kv_cache, MODEL)

    async def scenario():
        deliveries = Deliveries(loop, 2.0, prefill_metrics(engine))
        desc = source.describe("r2", out.held_block_ids, 20, out.block_hashes)
        result = await deliveries.deliver(desc, 1, f"127.0.0.1:{free_port()}")
        await until(lambda: not held(engine))
        await deliveries.close()
        return result

    accepted, reason, _ = asyncio.run(scenario())
    assert not accepted and "UNAVAILABLE" in reason
    source.close()


def test_a_cancelled_caller_leaves_the_delivery_to_end_before_the_release(engine, loop, prefill,
                                                                          decode_side):
    _, decode_loop, inbox = decode_side
    out = prefill("r3", prompt(90, 20))  # 2 blocks held
    source = KVSource(PREFILL, engine.kv_cache, MODEL)

    async def scenario():
        server = await serve_decode(inbox)
        deliveries = Deliveries(loop, 10.0, prefill_metrics(engine))
        try:
            desc = source.describe("r3", out.held_block_ids, 20, out.block_hashes)
            caller = asyncio.create_task(deliveries.deliver(desc, 5,
                                                            f"127.0.0.1:{server.port}"))
            await asyncio.sleep(0.2)  # the Deliver call waits for its Decode call
            caller.cancel()
            await asyncio.gather(caller, return_exceptions=True)
            assert deliveries.delivering("r3")
            assert await on_engine(loop, held) == {"r3": out.held_block_ids}  # still held
            taken = await inbox.take("r3", 2, PREFILL)  # the Decode call comes: it ends
            await until(lambda: not deliveries.delivering("r3") and not held(engine))
            return taken
        finally:
            await deliveries.close()
            await server.stop(0)

    taken = asyncio.run(scenario())
    assert len(taken.block_ids) == 2
    decode_loop.call(lambda e: e.kv.free(taken.block_ids)).result(timeout=5)
    source.close()

"""The handoff at tensor parallel size 2 without the services (common/engine/rank_kv.py): two real
TP 2 engines in this process (each with its rank 1 in a subprocess), the prefill one's pools in
/dev/shm files. Each rank's shard moves rank to rank (over shm, and over grpc as from another
host) and is verified there; the continuation equals TP 1's tokens; and what must be refused is
refused, by name, before any block is written (or with the rank whose shard failed)."""

from __future__ import annotations

import dataclasses

import pytest

from common.engine.config import EngineConfig
from common.engine.core.block_manager import hash_prefix_blocks
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine, Prefilled
from common.engine.rank_kv import RankShards
from common.errors import RankFailure, TransferError
from common.flags import build
from common.kv_transport.grpc_transport import KVTransferServicer
from common.kv_transport.locality import host_id
from common.kv_transport.select import KVReceiver
from common.kv_transport.shm import SharedMemoryPool
from common.kv_transport.source import KVSource
from common.serving.tls import PLAINTEXT
from tests.certs import make_ca, make_leaf
from tests.cluster import wait_until
from tests.common.kv_transport.test_grpc_transport import AioServer

pytestmark = pytest.mark.timeout(300)

MODEL = "dummy:tiny-llama"  # 2 KV heads: one per rank at TP 2
PROMPT = [3 + (7 * i) % 500 for i in range(37)]  # 3 blocks of 16, the last partial
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def config(tp: int) -> EngineConfig:
    return build(EngineConfig, model=MODEL, device="cpu", dtype="float32", num_kv_blocks=64,
                 block_size=16, cpu_threads=1, tensor_parallel_size=tp)


def finish(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, **kw):
    engine.add_request(rid, prompt, params, **kw)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    return final


@pytest.fixture(scope="module")
def pair():
    shm = SharedMemoryPool()
    prefill, decode = LLMEngine(config(2), kv_cache_allocator=shm), LLMEngine(config(2))
    source = KVSource("prefill-tp2", prefill.kv_cache, MODEL, shm=shm,
                      shards=RankShards.of(prefill))
    yield prefill, decode, source
    source.close()
    for engine in (prefill, decode):
        engine.close()
    shm.close()


def test_each_rank_pulls_its_shard_and_the_continuation_equals_tp1(pair):
    prefill, decode, source = pair
    whole = LLMEngine(config(1)).generate([PROMPT], GREEDY)[0].output_token_ids
    held = finish(prefill, "r1", PROMPT, dataclasses.replace(GREEDY, max_tokens=1),
                  hold_kv=True)
    assert held.output_token_ids == whole[:1]
    desc = source.describe("r1", held.held_block_ids, len(PROMPT),
                           hash_prefix_blocks(PROMPT, 16))
    assert desc.tensor_parallel_size == 2 and desc.num_kv_heads == 1
    assert [s["kv_heads"] for s in desc.shards] == [[0, 1], [1, 2]]
    assert list(desc.shards[1]["transports"]) == ["shm"]  # rank 1's pool is its own file
    assert desc.shards[1]["transports"]["shm"]["path"] != desc.transports["shm"]["path"]

    shards = RankShards.of(decode)
    blocks = decode.kv.reserve(len(held.held_block_ids))
    receiver = KVReceiver()
    name = shards.pull_all(desc, blocks, 10.0, host_id(),
                           lambda rank0: receiver.pull(rank0, decode.kv_cache, blocks))
    assert name == "local"  # rank 0 shares this process with its source; rank 1 used shm
    # Rank 1's copy, read back on rank 1: the same sums as the source's rank 1 blocks.
    assert shards.checksums(blocks) == RankShards.of(prefill).checksums(held.held_block_ids)
    prefill.kv.release("r1")
    got = finish(decode, "r1", PROMPT, GREEDY, prefilled=Prefilled(blocks, whole[0]))
    assert got.output_token_ids == whole
    for engine in (prefill, decode):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_what_a_receiver_refuses(pair):
    prefill, decode, source = pair
    held = finish(prefill, "r2", PROMPT, dataclasses.replace(GREEDY, max_tokens=1),
                  hold_kv=True)
    desc = source.describe("r2", held.held_block_ids, len(PROMPT), [])
    shards = RankShards.of(decode)
    blocks = decode.kv.reserve(len(held.held_block_ids))
    receiver = KVReceiver()

    def pull(d):
        return shards.pull_all(d, blocks, 10.0, host_id(),
                               lambda rank0: receiver.pull(rank0, decode.kv_cache, blocks))
    try:
        bad = [dict(s) for s in desc.shards]
        bad[1]["checksum"] += 1
        with pytest.raises(TransferError, match=r"handoff r2: rank 1: TransferError: handoff "
                                                r"r2: checksum mismatch over 3 blocks via shm"):
            pull(dataclasses.replace(desc, shards=bad))
        swapped = [dict(desc.shards[1]), dict(desc.shards[0])]
        with pytest.raises(TransferError, match=r"KV heads per rank \[\[1, 2\], \[0, 1\]\] are "
                                                r"not this instance's \[\[0, 1\], \[1, 2\]\]"):
            pull(dataclasses.replace(desc, shards=swapped))
        with pytest.raises(TransferError, match="the prefill instance runs at tensor parallel "
                                                "size 3, this decode instance at 2"):
            pull(dataclasses.replace(desc, tensor_parallel_size=3, shards=[*desc.shards,
                                                                           desc.shards[1]]))
        with pytest.raises(ValueError, match="no tensor parallel rank 2: the source has 2"):
            source.export_kv(held.held_block_ids, rank=2)
        # After every refusal the pipes are still in step: a good pull goes through.
        assert pull(desc) == "local"
    finally:
        decode.kv.free(blocks)
        prefill.kv.release("r2")


class _Late:
    """The servicer's source, set once the server's port (the source's address) is known."""
    source: KVSource

    def export_kv(self, block_ids, rank=0):
        return self.source.export_kv(block_ids, rank)


@pytest.mark.parametrize("mtls", [False, True], ids=["plaintext", "mtls"])
def test_each_rank_pulls_its_shard_over_grpc_from_another_host(pair, tmp_path, mtls):
    """With mTLS the source's server asks for a client certificate: rank 1 dials with the
    TLS settings rank 0 hands it (its own certificate, the CA of the source's)."""
    prefill, decode, _ = pair
    server_tls = client_tls = PLAINTEXT
    if mtls:
        ca = make_ca(tmp_path)
        server_tls = make_leaf(tmp_path, "prefill", ca).tls(ca, client_auth=True)
        client_tls = make_leaf(tmp_path, "decode", ca).tls(ca)
    late = _Late()
    server = AioServer(KVTransferServicer(late), server_tls)
    late.source = source = KVSource("prefill-tp2-grpc", prefill.kv_cache, MODEL,
                                    address=f"127.0.0.1:{server.port}",
                                    shards=RankShards.of(prefill))
    held = finish(prefill, "r3", PROMPT, dataclasses.replace(GREEDY, max_tokens=1),
                  hold_kv=True)
    shards = RankShards.of(decode)
    blocks = decode.kv.reserve(len(held.held_block_ids))
    try:
        desc = source.describe("r3", held.held_block_ids, len(PROMPT), [])
        assert desc.shards[1]["transports"]["grpc"] == {"address": f"127.0.0.1:{server.port}",
                                                        "rank": 1}
        # From "another host" (and another process: rank 0's local offer goes): no shm, no
        # local; every rank pulls its shard over grpc.
        rank0 = {k: v for k, v in desc.transports.items() if k != "local"}
        elsewhere = dataclasses.replace(
            desc, source_host_id="elsewhere", transports=rank0,
            shards=[{**desc.shards[0], "transports": rank0}, desc.shards[1]])
        receiver = KVReceiver(tls=client_tls)
        name = shards.pull_all(elsewhere, blocks, 10.0, host_id(),
                               lambda rank0: receiver.pull(rank0, decode.kv_cache, blocks),
                               client_tls)
        assert name == "grpc"
        assert shards.checksums(blocks) == RankShards.of(prefill).checksums(held.held_block_ids)
        receiver.close()
    finally:
        decode.kv.free(blocks)
        prefill.kv.release("r3")
        source.close()
        server.stop()


def test_a_rank_gone_fails_the_pull_with_rank_failure(pair):
    """A receiver whose rank 1 died: the pull raises RankFailure naming it (the decode service
    frees the blocks and its instance goes down), before writing anything."""
    prefill, _, source = pair
    held = finish(prefill, "r4", PROMPT, dataclasses.replace(GREEDY, max_tokens=1),
                  hold_kv=True)
    desc = source.describe("r4", held.held_block_ids, len(PROMPT), [])
    prefill.kv.release("r4")
    doomed = LLMEngine(config(2))
    try:
        doomed.ranks.procs[0].kill()
        doomed.ranks.procs[0].wait(10)
        wait_until("rank 0 to see rank 1 exit", lambda: doomed.ranks.failure, 10)
        blocks = doomed.kv.reserve(len(desc.block_ids))
        with pytest.raises(RankFailure, match="tensor parallel rank 1 exited with code -9"):
            RankShards.of(doomed).pull_all(desc, blocks, 10.0, host_id(), lambda _: "unused")
    finally:
        doomed.close()

"""The handoff checksum queued behind a held prompt's last step (KVConnector.queue_checksum) on
CUDA (skipped without it): it equals the checksum computed afterwards from the held blocks, with
overlap scheduling, chunked prompts and other requests in the same steps; releasing forgets it."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.kv_transport.checksum import kv_checksum

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_queued_checksum_equals_the_held_blocks_checksum(overlap):
    e = LLMEngine(build(EngineConfig, model="dummy:tiny-llama", device="cuda", dtype="bfloat16",
                        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                        num_kv_blocks=256, block_size=16, overlap_scheduling=overlap))
    rng = random.Random(5)
    prompts = {f"held-{n}": [rng.randrange(512) for _ in range(n)] for n in (13, 45, 150)}
    for rid, prompt in prompts.items():  # 150 tokens: three chunks of at most 64
        e.add_request(rid, prompt, SamplingParams(max_tokens=1), hold_kv=True)
    e.add_request("other", prompts["held-45"][:20], SamplingParams(max_tokens=12))
    held = {}
    while e.has_unfinished():
        for out in e.step():
            if out.held_block_ids is not None:
                held[out.request_id] = out.held_block_ids
    assert set(held) == set(prompts)
    for rid, blocks in held.items():
        got = e.kv.checksum_of(rid, blocks)
        assert got is not None and got == kv_checksum(e.kv_cache, blocks), rid
        assert e.kv.checksum_of(rid, blocks[:-1]) is None  # other blocks: computed by the caller
        assert e.abort(rid)
        assert e.kv.checksum_of(rid, blocks) is None
    assert e.block_manager.num_used_blocks == 0

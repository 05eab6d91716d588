"""One handoff's data path without the services: describe, the descriptor through its JSON (as
DecodeService.Deliver carries it), pull into other block ids, verify."""

from __future__ import annotations

import torch

from common.engine.core.block_manager import hash_prefix_blocks
from common.kv_transport.select import KVReceiver
from common.kv_transport.source import KVSource
from common.registry import HandoffDescriptor


def test_handoff_through_its_descriptor() -> None:
    prefill_pool = torch.randn([2, 2, 8, 4, 1, 8], generator=torch.Generator().manual_seed(9))
    decode_pool = torch.zeros([2, 2, 5, 4, 1, 8])
    prompt = list(range(30, 44))                       # 14 tokens: 3 full blocks and one partial
    held = [6, 2, 5, 0]
    source = KVSource("prefill-0", prefill_pool, "test-model", address="127.0.0.1:1")
    desc = source.describe("req-7", held, num_tokens=len(prompt),
                           block_hashes=hash_prefix_blocks(prompt, 4))
    claimed = HandoffDescriptor.from_json(desc.to_json())
    assert claimed == desc
    receiver = KVReceiver()
    reserved = [4, 3, 1, 0]
    assert receiver.pull(claimed, decode_pool, reserved) == "local"
    for s, d in zip(held, reserved, strict=True):
        assert torch.equal(decode_pool[:, :, d], prefill_pool[:, :, s])
    receiver.close()
    source.close()

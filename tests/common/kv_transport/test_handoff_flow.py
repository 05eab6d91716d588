"""One handoff end to end through a real Redis: publish, claim, pull, confirm, release."""

from __future__ import annotations

import torch

from common.engine.core.block_manager import hash_prefix_blocks
from common.kv_transport.select import KVReceiver
from common.kv_transport.source import KVSource
from common.registry import EmbeddedRedis, HandoffState, Registry


def test_handoff_through_the_registry() -> None:
    prefill_pool = torch.randn([2, 2, 8, 4, 1, 8], generator=torch.Generator().manual_seed(9))
    decode_pool = torch.zeros([2, 2, 5, 4, 1, 8])
    prompt = list(range(30, 44))                       # 14 tokens: 3 full blocks and one partial
    held = [6, 2, 5, 0]
    with EmbeddedRedis() as server, Registry(server.url, "flow") as registry:
        source = KVSource("prefill-0", prefill_pool, "test-model", address="127.0.0.1:1")
        desc = source.describe("req-7", held, num_tokens=len(prompt),
                               block_hashes=hash_prefix_blocks(prompt, 4))
        registry.publish_handoff(desc, lease_ttl_s=10)

        claimed = registry.claim_handoff("req-7", "decode-0")
        assert claimed == desc
        receiver = KVReceiver()
        reserved = [4, 3, 1, 0]
        assert receiver.pull(claimed, decode_pool, reserved) == "local"
        assert registry.complete_handoff("req-7", claimer="decode-0") is True
        for s, d in zip(held, reserved, strict=True):
            assert torch.equal(decode_pool[:, :, d], prefill_pool[:, :, s])

        # The prefill side's poll: the record is gone and confirmed, so it releases `held`.
        assert registry.reap_handoffs(["req-7"]) == {"req-7": HandoffState.DONE}
        registry.clear_instance("prefill-0")
        assert registry.namespace_keys() == []
        receiver.close()
        source.close()

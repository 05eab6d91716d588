"""Which instance serves a request (pure Python policy; the gateway feeds it registry data).

Prefill: prefix-cache-aware, weighed with load. An instance's score is

    prefix_token_weight * (prompt tokens found in its prefix cache)
      - queued_request_cost_tokens * (its load: requests queued there)

where load = max(requests this gateway has in flight there, what the instance last reported
running) + what it reported waiting. Reports are up to one heartbeat old, so the gateway's own
in-flight count keeps a burst of requests from all landing on one instance.

Decode: among instances with enough free KV blocks for the request (all, if none has), the one
with the least load; ties go to more free blocks, then to the instance id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from common.errors import NoInstanceError
from common.registry.records import InstanceInfo
from gateway.config import RouterConfig


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.inflight: Counter[str] = Counter()  # instance id -> requests this gateway sent there

    def load(self, info: InstanceInfo) -> int:
        return max(self.inflight[info.instance_id], info.num_running) + info.num_waiting

    def pick_prefill(self, instances: Sequence[InstanceInfo],
                     cached_blocks: Mapping[str, int]) -> InstanceInfo:
        """cached_blocks: instance id -> leading prompt blocks in its prefix cache."""
        if not instances:
            raise NoInstanceError("no prefill instance is registered")
        cfg = self.config

        def score(info: InstanceInfo) -> tuple[float, int, str]:
            cached_tokens = cached_blocks.get(info.instance_id, 0) * info.block_size
            value = (cfg.prefix_token_weight * cached_tokens
                     - cfg.queued_request_cost_tokens * self.load(info))
            return (-value, self.load(info), info.instance_id)

        return min(instances, key=score)

    def pick_decode(self, instances: Sequence[InstanceInfo], num_tokens: int) -> InstanceInfo:
        """num_tokens: prompt plus max_tokens (the blocks the request may come to need)."""
        if not instances:
            raise NoInstanceError("no decode instance is registered")

        def blocks(info: InstanceInfo) -> int:
            return -(-num_tokens // max(info.block_size, 1))

        fitting = [i for i in instances if i.free_blocks >= blocks(i)] or list(instances)
        return min(fitting, key=lambda i: (self.load(i), -i.free_blocks, i.instance_id))

    def acquire(self, instance_id: str) -> None:
        self.inflight[instance_id] += 1

    def release(self, instance_id: str) -> None:
        self.inflight[instance_id] -= 1
        if self.inflight[instance_id] <= 0:
            del self.inflight[instance_id]

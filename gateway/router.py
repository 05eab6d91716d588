"""Which instance serves a request (pure Python policy; the gateway feeds it registry data).

Prefill: prefix-cache-aware, weighed with load. An instance's score is

    prefix_token_weight * (prompt tokens found in its prefix cache)
      - queued_request_cost_tokens * (its load: requests queued there)

where load = max(requests this gateway has in flight there, what the instance last reported
running) + what it reported waiting. Reports are up to one heartbeat old, so the gateway's own
in-flight count keeps a burst of requests from all landing on one instance.

Pairs: a prefill instance hands its KV to a decode instance rank to rank, so the two must have
the same tensor parallel size; when no prefill instance of the decode instance's size is
registered (but some of another size are), the decode instance prefills the prompt itself.

Decode: among instances with enough free KV blocks for the request (all, if none has), the one
with the least load; ties go to more free blocks, then to the instance id.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence

from common.errors import NoInstanceError
from common.registry.records import InstanceInfo
from gateway.config import RouterConfig

log = logging.getLogger("splitserve.gateway.router")


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.inflight: Counter[str] = Counter()  # instance id -> requests this gateway sent there
        self.unpaired: set[str] = set()  # decode instances no prefill instance can pair with

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

    def pairable(self, prefills: Sequence[InstanceInfo],
                 decode: InstanceInfo) -> list[InstanceInfo]:
        """The prefill instances that can hand their KV to `decode` (its tensor parallel size);
        all of them when none is registered (pick_prefill then says so). Empty: prefill on the
        decode instance."""
        if not prefills:
            return list(prefills)
        same = [p for p in prefills if p.tensor_parallel_size == decode.tensor_parallel_size]
        if not same and decode.instance_id not in self.unpaired:  # said once per instance
            self.unpaired.add(decode.instance_id)
            log.warning("no prefill instance runs at tensor parallel size %d like decode "
                        "instance %s (sizes: %s): it prefills the prompt itself",
                        decode.tensor_parallel_size, decode.instance_id,
                        sorted({p.tensor_parallel_size for p in prefills}))
        return same

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

"""The KV handoff under tensor parallelism: each rank's shard of the blocks moves rank to rank.

    prefill instance, size N                          decode instance, size N
    rank 0  KVSource.describe: its checksum     --->  rank 0  HandoffInbox: pull_all
            and every rank's (asked down the           |  "pull" down each rank's handoff pipe
            handoff pipes): shards[r] =                 v
            {kv_heads, checksum, transports}          rank r  pulls shard r into the reserved
    rank r  pool in a /dev/shm file            <---           blocks of its own pool over shm
            or, over grpc, exported through           (one host) or grpc (PullBlocks with
            rank 0's KVTransferService                tensor_parallel_rank r), verifies shard
                                                      r's checksum, answers rank 0

Every rank's pool is [layers, 2, blocks, block_size, its KV heads, head_dim] under the same block
ids (common/engine/parallel.py), so rank r of the receiver pulls shard r of the source with the
plain transports (common/kv_transport), on its own pool: only the descriptor crosses the pipes
(and, for a grpc pull, rank r's blocks on the source side: rank 0's server asks rank r for them).
Each rank serves its handoff pipe on a thread of its own (serve_handoffs), beside its steps and
under rank 0's rule for transfer threads (common/engine/kv_connector.py): it reads held blocks and
writes reserved ones, which no step touches. A receiver's ranks choose their transport by rank
0's host id and dial with its TLS settings (they run on its host).

Same size only: rank r's KV heads must be shard r's (pull_all checks); a prefill and a decode
instance of different sizes are never paired (gateway/router.py), and a receiver of another size
refuses the descriptor. GPU pools are not offered per rank (no cuda_ipc per rank yet): the
services run TP > 1 on CPU ranks only (splitserve/commands/service.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from common.engine.parallel import RankWorkers
from common.errors import RankFailure, TransferError
from common.kv_transport.blocks import dtype_from_name, dtype_name
from common.kv_transport.checksum import kv_checksum
from common.kv_transport.select import KVReceiver
from common.models.sharding import Shard, shard_layout
from common.registry.records import HandoffDescriptor
from common.serving.tls import PLAINTEXT, TlsConfig

REPLY_MARGIN_S = 10.0  # a rank answers a pull within its transport's timeout plus this


class RankShards:
    """Rank 0's handle on the other ranks' pools for handoffs (of(engine): None at size 1).
    Any thread may call it; one command round at a time (RankWorkers.kv_lock)."""

    def __init__(self, ranks: RankWorkers, kv_heads: list[list[int]]):
        self.ranks = ranks
        self.kv_heads = kv_heads  # per rank, [first, end) of its KV heads

    @classmethod
    def of(cls, engine) -> RankShards | None:
        if engine.ranks is None:
            return None
        n = engine.ranks.size
        layouts = [shard_layout(engine.model_config, Shard(r, n)) for r in range(n)]
        return cls(engine.ranks, [[lay.kv_head_start, lay.kv_head_start + lay.num_kv_heads]
                                  for lay in layouts])

    @property
    def size(self) -> int:
        return self.ranks.size

    def offers(self) -> list[dict[str, dict[str, Any]]]:
        """The transports each rank above 0 offers its pool over."""
        return self._round(("offers",), 30.0)

    def checksums(self, block_ids: Sequence[int]) -> list[int]:
        """kv_checksum of the blocks on each rank above 0."""
        return self._round(("checksum", list(block_ids)), 30.0)

    def export(self, rank: int, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of rank `rank`'s blocks (KVSource.export_kv, for a grpc pull of its shard)."""
        with self.ranks.kv_lock:
            conn = self.ranks.kv_conns[rank - 1]
            self._send(("export", list(block_ids)), [conn])
            (ok, value), = self._receive(30.0, [conn])
        if not ok:
            raise ValueError(f"tensor parallel rank {rank}: {value}")
        shape, dtype, data = value
        return torch.frombuffer(bytearray(data), dtype=dtype_from_name(dtype)).view(shape)

    def describe(self, desc: HandoffDescriptor,
                 offers: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """The descriptor's shards: rank 0's from desc, the others' asked now."""
        sums = [desc.checksum, *self.checksums(desc.block_ids)]
        transports = [desc.transports, *offers]
        return [{"kv_heads": heads, "checksum": s, "transports": t}
                for heads, s, t in zip(self.kv_heads, sums, transports, strict=True)]

    def pull_all(self, desc: HandoffDescriptor, dst_block_ids: Sequence[int], timeout_s: float,
                 local_host: str, pull_rank0: Callable[[HandoffDescriptor], str],
                 tls: TlsConfig = PLAINTEXT) -> str:
        """Every rank pulls its shard into dst_block_ids; pull_rank0 (rank 0's own pull, run
        while the others pull theirs) returns the transport's name, which this returns. Raises
        TransferError naming the rank whose pull failed. local_host: this instance's host id
        (its ranks share it), tls: how its ranks dial a grpc source."""
        if desc.tensor_parallel_size != self.size:
            raise TransferError(
                f"handoff {desc.request_id}: the prefill instance runs at tensor parallel size "
                f"{desc.tensor_parallel_size}, this decode instance at {self.size}; the KV moves "
                "rank to rank between instances of one size only")
        heads = [shard["kv_heads"] for shard in desc.shards]
        if heads != self.kv_heads:
            raise TransferError(f"handoff {desc.request_id}: the source's KV heads per rank "
                                f"{heads} are not this instance's {self.kv_heads}")
        with self.ranks.kv_lock:
            self._send(("pull", desc.to_json(), list(dst_block_ids), timeout_s, local_host, tls))
            try:
                name = pull_rank0(desc.for_rank(0))
            finally:  # the other ranks' answers, even when rank 0's pull failed
                replies = self._receive(timeout_s + REPLY_MARGIN_S)
        failed = [f"rank {r}: {why}" for r, (ok, why) in enumerate(replies, start=1) if not ok]
        if failed:
            raise TransferError(f"handoff {desc.request_id}: " + "; ".join(failed))
        return name

    def _round(self, message: tuple, timeout_s: float) -> list:
        with self.ranks.kv_lock:
            self._send(message)
            replies = self._receive(timeout_s)
        for rank, (ok, value) in enumerate(replies, start=1):
            if not ok:
                raise TransferError(f"tensor parallel rank {rank}: {value}")
        return [value for _, value in replies]

    def _send(self, message: tuple, conns: Sequence[Connection] | None = None) -> None:
        self.ranks._check()
        for conn in self.ranks.kv_conns if conns is None else conns:
            try:
                conn.send(message)
            except OSError as e:
                raise RankFailure(f"tensor parallel rank gone: {self.ranks.failure or e}") from e

    def _receive(self, timeout_s: float,
                 conns: Sequence[Connection] | None = None) -> list[tuple[bool, Any]]:
        """One (ok, value) per rank above 0 (or per conn of `conns`). A rank that does not answer in time leaves its
        pipe out of step, so the engine is marked failed (RankFailure from then on)."""
        replies = []
        for conn in self.ranks.kv_conns if conns is None else conns:
            rank = self.ranks.kv_conns.index(conn) + 1
            waited = 0.0
            while not conn.poll(0.2):
                waited += 0.2
                self.ranks._check()
                if waited > timeout_s:
                    self.ranks.failure = (f"rank {rank} did not answer a handoff command within "
                                          f"{timeout_s:.0f} s")
                    self.ranks._check()
            try:
                replies.append(conn.recv())
            except (EOFError, OSError) as e:
                raise RankFailure(f"tensor parallel rank {rank} gone: {e}") from e
        return replies


def serve_handoffs(rank: int, runner, conn: Connection, shm) -> None:
    """Rank r's thread: answers rank 0's handoff commands until its pipe closes. shm: the
    SharedMemoryPool that holds the rank's pool, if any (a prefill instance's)."""
    receivers: dict[tuple[str, TlsConfig], KVReceiver] = {}  # by (host, tls): rank 0's
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        what, *args = message
        try:
            if what == "offers":
                value: Any = {"shm": shm.describe()} if shm is not None else {}
            elif what == "checksum":
                value = kv_checksum(runner.kv_cache, args[0])
            elif what == "export":
                kv = runner.export_kv(args[0]).contiguous()
                value = (list(kv.shape), dtype_name(kv.dtype),
                         kv.view(-1).view(torch.uint8).numpy().tobytes())
            elif what == "pull":
                text, block_ids, timeout_s, host, tls = args
                receiver = receivers.get((host, tls))
                if receiver is None:
                    receiver = receivers[host, tls] = KVReceiver(host, timeout_s, tls)
                receiver.timeout_s = timeout_s
                desc = HandoffDescriptor.from_json(text).for_rank(rank)
                value = receiver.pull(desc, runner.kv_cache, block_ids)
            else:
                raise ValueError(f"unknown handoff command {what!r}")
            reply = (True, value)
        except Exception as e:  # answered: rank 0 decides (the KV is recomputed)
            reply = (False, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except OSError:
            return

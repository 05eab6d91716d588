"""KVConnector: the engine's side of a KV handoff, i.e. the blocks that live outside any running
sequence while their KV moves between services.

    prefill side:  add_request(..., hold_kv=True) -> the prompt finishes -> held[request_id]
                   -> the KV is read out (a transport, export) -> release(request_id)
    decode side:   reserve_for_copy(n) -> (blocks, event) -> a transport writes them (import)
                   -> add_request(Prefilled(blocks)) hands them to a sequence, or free(blocks)

Ownership: a held block belongs to its request until release(); a reserved block belongs to the
caller of reserve() until it hands it to the engine (Prefilled) or frees it. Neither is touched by
the engine's steps meanwhile: a held block's sequence has finished, and a reserved block belongs
to no sequence.

Thread rule: every method runs on the engine's thread (services call through EngineLoop.call),
except reads of `pool`, the KV pool tensor itself, which transfer threads may read (held blocks)
and write (reserved blocks) while the engine steps, and `checksum_of` and `watch`, which any
thread may call. A copy into reserved blocks on a GPU first waits for the event
reserve_for_copy() returned, if any (the step in flight may still write blocks that were free
when it was launched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from common.engine.core.block_manager import BlockManager
from common.engine.uploads import to_device
from common.kv_transport.checksum import combine

IPC_EVENTS = 32  # interprocess events that early handoffs name, reused round robin

log = logging.getLogger("splitserve.engine.kv")


class KVConnector:
    def __init__(self, block_manager: BlockManager, runner, cuda_index: int | None,
                 step_in_flight_may_write_free_blocks: Callable[[], bool],
                 use_device: Callable[[], None]):
        """runner: the model runner (its kv_cache, export_kv, import_kv). cuda_index: the
        engine's GPU, None on a CPU."""
        self.block_manager = block_manager
        self.runner = runner
        self._cuda_index = cuda_index
        self._may_write_free = step_in_flight_may_write_free_blocks
        self._use_device = use_device
        self.held: dict[str, list[int]] = {}
        # Checksums queued right after the step that wrote a held prompt's last KV (see
        # queue_checksum): request id -> (block ids, pinned [n, 2] sums, event when copied).
        self._sums: dict[str, tuple[list[int], torch.Tensor, torch.cuda.Event]] = {}
        # Early handoffs (see watch): request id -> callback; the interprocess events they are
        # told of, reused round robin, with their handles.
        self._watchers: dict[str, Callable[[list[int], bytes], None]] = {}
        self._ipc_events: list[tuple[torch.cuda.Event, bytes]] = []
        self._next_ipc_event = 0

    @property
    def pool(self) -> torch.Tensor:
        """The KV pool, [layers, 2, blocks, block_size, kv_heads, head_dim] (see the thread
        rule)."""
        return self.runner.kv_cache

    # ---- the prefill side ------------------------------------------------------------------
    def hold(self, request_id: str, block_table: list[int]) -> None:
        """A finished request's blocks stay allocated under its id (engine, at finish)."""
        self.held[request_id] = block_table

    def release(self, request_id: str) -> bool:
        """Free a request's held blocks; False if it holds none."""
        table = self.held.pop(request_id, None)
        self._sums.pop(request_id, None)
        self._watchers.pop(request_id, None)
        if table is None:
            return False
        self.block_manager.free(table)
        return True

    def release_all(self) -> None:
        for request_id in list(self.held):
            self.release(request_id)

    def queue_checksum(self, request_id: str, block_ids: Sequence[int]) -> None:
        """On a GPU, within the step that computes a held prompt's last KV, after its forward
        and before its sampling (the runner's after_forward): queue the handoff checksum's
        per-block sums of the blocks on the engine's stream, and their copy to the host. They
        are done when the step's token is read (a kernel of ~20 us more in that step), so the
        delivery needs no GPU work of its own: run after the step, in the prefill process, that
        work waited up to ~2 ms for the GPU while another process (the decode service) held
        it. No-op on a CPU."""
        if self._cuda_index is None or not self.pool.is_contiguous():
            return
        from kernels.block_sums import block_sums  # CPU-only processes never load Triton
        ids = list(block_ids)
        watcher = self._watchers.pop(request_id, None)
        if watcher is not None:  # the forward that writes the prompt's last KV is queued
            try:
                event, handle = self._ipc_event()
                event.record()
                watcher(ids, handle)
            except Exception:  # never into the step: the handoff goes the usual way
                log.exception("request %s: the early handoff's event failed", request_id)
        sums = block_sums(self.pool, to_device(ids, torch.long, self.pool.device))
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._sums[request_id] = (ids, host, event)

    def watch(self, request_id: str, callback: Callable[[list[int], bytes], None]) -> None:
        """Any thread, before the request is submitted: on a GPU, when the step that writes a
        held prompt's last KV is launched (queue_checksum), callback(block ids, handle) is
        called on the engine thread with the CUDA IPC handle of an event recorded right behind
        that step's forward (an early handoff: another process may wait for the event and copy
        the blocks then). Once per request; never on a CPU. release() forgets it, so the
        engine's abort of a request that never reached its last step does too."""
        self._watchers[request_id] = callback

    def _ipc_event(self) -> tuple[torch.cuda.Event, bytes]:
        """The next of IPC_EVENTS interprocess events, round robin. A process waiting for an
        event that was recorded again since waits for the later record (a later step on the
        same stream): later, never too soon."""
        if len(self._ipc_events) < IPC_EVENTS:
            event = torch.cuda.Event(interprocess=True)
            event.record()  # torch creates the event at its first use: on this device, now
            self._ipc_events.append((event, event.ipc_handle()))
        pair = self._ipc_events[self._next_ipc_event % len(self._ipc_events)]
        self._next_ipc_event += 1
        return pair

    def checksum_of(self, request_id: str, block_ids: Sequence[int]) -> int | None:
        """Any thread: the handoff checksum (common.kv_transport.checksum) of a held prompt's
        blocks from what queue_checksum queued, waiting for its step if need be; None when
        nothing was queued for exactly these blocks (the caller computes it)."""
        entry = self._sums.get(request_id)
        if entry is None or entry[0] != list(block_ids):
            return None
        _, host, event = entry
        event.synchronize()
        return combine(host.tolist())

    def export(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        self._use_device()
        return self.runner.export_kv(block_ids)

    # ---- the decode side -------------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """n fresh blocks that belong to no sequence (NoFreeBlocksError if the pool lacks them)."""
        return self.block_manager.allocate_blocks(n)

    def reserve_for_copy(self, n: int) -> tuple[list[int], torch.cuda.Event | None]:
        """reserve(n), and the event on the engine's stream that work on another stream writing
        them must wait for first: None when it need not wait (always on a CPU)."""
        blocks = self.reserve(n)
        if self._cuda_index is None or not self._may_write_free():
            return blocks, None
        self._use_device()
        event = torch.cuda.Event()
        event.record()
        return blocks, event

    def free(self, block_ids: list[int]) -> None:
        """Give back reserved blocks."""
        self.block_manager.unref_blocks(block_ids)

    def import_(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write kv, shaped as export() returns it, into reserved blocks."""
        self._use_device()
        self.runner.import_kv(block_ids, kv)

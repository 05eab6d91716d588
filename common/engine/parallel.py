"""Tensor parallelism's processes: one per rank, over a torch.distributed process group (gloo on
the CPU, NCCL on CUDA), rank 0 being the engine's own process.

    rank 0 (LLMEngine)                              ranks 1..N-1 (rank_main, subprocesses)
    schedule -> StepInput ---- pipe, pickled ---->  StepInput
    forward on its shard   <-- all-reduces ----->   forward on its shard
    logits [n, V/N]        <-- gather to rank 0 --  logits [n, V/N]
    sample (rank 0 only)

Only rank 0 schedules and samples; the others hold their KV heads of every block, under the
block ids rank 0's block manager chose (every rank's pool has the same number of blocks: rank 0
tells them). A step's input travels as host lists through one pipe per rank, not through a
collective, so an idle engine waits on no collective; overlap placeholders (tokens still on rank
0's device) reach the other ranks by one broadcast of the step's input ids.

The KV handoff (common/engine/rank_kv.py) talks to the ranks over a second pipe each, so that
its commands (checksum held blocks, pull a peer rank's shard into reserved blocks) run on a
thread of each rank beside its steps, and never wait behind them.

Failure rules: every collective runs under the group's timeout (--tp-timeout-s); a rank that
dies breaks the others' collectives at once (gloo: "connection closed by peer") and a thread
of rank 0 sees it exit, so the next step, or the one in progress, raises RankFailure
and the engine never steps again. A rank whose pipe closes (rank 0 gone) exits; close() stops
them all.

CUDA graphs: RankGroup.all_reduce is in place on the tensor it is given, allocates nothing and
never syncs the host (ProcessGroupNCCL orders its stream after the current one by events, and
wait() only makes the current stream wait for it), which is what CUDA graph capture needs: after
one eager step, a graph captured on every rank around the same forward records the NCCL
all-reduces and replays them (the logits gather allocates its parts, so a captured step would
gather into persistent buffers).
Today TP steps on CUDA run eagerly (LLMEngine uses the plain ModelRunner when the TP size is
above 1): graphs need the other ranks to replay the same graph for each step, i.e. a
CudaGraphRunner on every rank choosing its bucket from the StepInput it receives (the choice is
deterministic), which belongs with the multi-GPU issue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from common.engine.config import EngineConfig
from common.engine.step_input import StepInput
from common.errors import RankFailure
from common.models.sharding import Shard

log = logging.getLogger("splitserve.parallel")

_HOST = "127.0.0.1"  # ranks of one instance share a host


class RankGroup:
    """common.models.sharding.Collectives over a torch.distributed process group built for one
    engine (not the process-global default group: a process may hold several engines). A
    collective that fails or outlasts the timeout raises RankFailure."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float):
        self.rank, self.size = rank, size
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        except RuntimeError as e:
            raise RankFailure(f"tensor parallel group (rank {rank} of {size}): {e}") from e
        self.failure: str | None = None  # set on rank 0 when a rank exits
        # Benchmarks (bench/tp_step.py): with `timed`, host seconds and calls per collective,
        # waiting for the slowest rank included. Host time is the collective's on the CPU;
        # on CUDA wait() returns before the device is done, so it measures only the launch.
        self.timed = False
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _wait(self, work: dist.Work, what: str, start: float = 0.0) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RankFailure(f"tensor parallel {what} failed on rank {self.rank} of "
                              f"{self.size}: {self.failure or e}") from e
        if self.timed:
            self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - start
            self.calls[what] = self.calls.get(what, 0) + 1

    def _start(self) -> float:
        return time.perf_counter() if self.timed else 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = self._start()
        self._wait(self.pg.allreduce([x]), "all-reduce", start)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        start = self._start()
        x = x.contiguous()
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self._wait(self.pg.gather(parts, [x], opts), "gather", start)
        return torch.cat(parts[0], dim=-1) if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        start = self._start()
        self._wait(self.pg.broadcast([x], opts), "broadcast", start)
        return x


def threads_per_rank(config: EngineConfig) -> int:
    """--cpu-threads for each rank, else the machine's cores shared among the ranks."""
    return config.model.cpu_threads or max(
        1, (os.cpu_count() or 1) // config.parallel.tensor_parallel_size)


class RankWorkers:
    """Rank 0's handle on ranks 1..N-1: the constructor starts them (`python -m
    common.engine.parallel`, each with one end of a socket pair as its pipe) and joins the group
    with them; start_runners() gives them the pool's geometry and waits until each holds its
    model and pool; lead_step() sends every step; close() stops them. A thread per rank watches
    it exit; on_failure, if set, is called (from that thread) with why."""

    def __init__(self, config: EngineConfig, device: torch.device):
        self.size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.tp_timeout_s
        self.failure: str | None = None  # why the ranks cannot step any more
        self.on_failure: Callable[[str], None] | None = None
        self._closing = False
        self.kv_conns: list[Connection] = []  # the handoff's pipes (common/engine/rank_kv.py)
        self.kv_lock = threading.Lock()  # one handoff command round at a time
        store = dist.TCPStore(_HOST, 0, self.size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            kv_ours, kv_theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "common.engine.parallel", str(rank), str(store.port),
                 str(theirs.fileno()), str(kv_theirs.fileno())],
                pass_fds=(theirs.fileno(), kv_theirs.fileno()))
            theirs.close()
            kv_theirs.close()
            self.kv_conns.append(Connection(kv_ours.detach()))
            conn = Connection(ours.detach())
            conn.send((config, str(device)))
            self.conns.append(conn)
            self.procs.append(proc)
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}",
                             daemon=True).start()
        try:  # the group's timeout is the collectives': join once every rank is about to
            self._replies("joining")
            self.group = self._until_failure(
                lambda: RankGroup(store, 0, self.size, device, self.timeout_s))
        except BaseException:
            self.close()
            raise
        self.group.failure = self.failure
        self._store = store  # the ranks' rendezvous: kept while the group lives

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closing:
            return
        self.failure = f"rank {rank} exited with code {code}"
        if getattr(self, "group", None) is not None:
            self.group.failure = self.failure
        log.error("tensor parallel %s: the engine cannot step again", self.failure)
        if self.on_failure is not None:
            self.on_failure(f"tensor parallel {self.failure}")

    def _until_failure(self, fn):
        """fn() on a thread, waited for while no rank has exited (then RankFailure)."""
        result: list = []

        def run() -> None:
            try:
                result.append((True, fn()))
            except BaseException as e:  # handed to the caller
                result.append((False, e))
        thread = threading.Thread(target=run, name="tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            self._check()
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def _check(self) -> None:
        if self.failure is not None:
            raise RankFailure(f"tensor parallel {self.failure}")

    def _send(self, message: object) -> None:
        self._check()
        for conn in self.conns:
            try:
                conn.send(message)
            except OSError as e:  # a pipe whose rank is gone
                raise RankFailure(f"tensor parallel rank gone: {self.failure or e}") from e

    def start_runners(self, num_blocks: int, max_model_len: int,
                      shared_pools: bool = False) -> None:
        """Each rank builds its runner with rank 0's pool size (the same block ids on every
        rank), its pool in a /dev/shm file when shared_pools (a prefill service's, which decode
        ranks map); returns when all are ready, or raises RankFailure with a rank's error."""
        self._send((num_blocks, max_model_len, shared_pools))
        try:
            self._replies("ready")
        except BaseException:
            self.close()
            raise

    def _replies(self, expected: str) -> None:
        """Waits (with no timeout: loading a model takes what it takes) until every rank has
        sent `expected`, or one fails or exits (RankFailure with its error)."""
        for rank, conn in enumerate(self.conns, start=1):
            reply = None
            while reply is None:
                if conn.poll(0.2):
                    try:
                        reply = conn.recv()
                    except EOFError:
                        reply = "it exited"
                elif self.failure is not None:
                    reply = f"it exited ({self.failure})"
            if reply != expected:
                raise RankFailure(f"tensor parallel rank {rank} failed to start: {reply}")

    def lead_step(self, step: StepInput, input_ids: torch.Tensor, logits: bool,
                  prompt_rows: list[tuple[int, int]] = ()) -> None:
        """Sends the step to the other ranks before rank 0's forward; logits: whether the step
        computes logits (some sequence samples); prompt_rows: (first row, rows) of each
        prompt_logprobs slice rank 0 computes the logits of first, in order."""
        self._send((step, logits, list(prompt_rows)))
        if step.placeholder_dst:
            self.group.broadcast(input_ids)

    def close(self) -> None:
        """Stops every rank (a None message, then SIGTERM after a grace, then SIGKILL)."""
        if self._closing:
            return
        self._closing = True
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            for stop in (None, proc.terminate, proc.kill):
                if stop is not None:
                    stop()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
                    break
        for conn in self.conns + self.kv_conns:
            conn.close()


def rank_main(rank: int, port: int, conn: Connection, kv_conn: Connection) -> None:
    """A rank other than 0: join the group, load this rank's shard, build its runner with the
    pool size rank 0 sends, then run every step rank 0 sends until None or rank 0 is gone."""
    from common.engine.engine import resolve_dtype
    from common.engine.model_runner import ModelRunner
    from common.engine.rank_kv import serve_handoffs
    from common.kv_transport.shm import SharedMemoryPool
    from common.models.loader import load_model

    try:
        config, device_name = conn.recv()
        size = config.parallel.tensor_parallel_size
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(threads_per_rank(config))
        torch.manual_seed(config.model.seed)
        store = dist.TCPStore(_HOST, port, size, is_master=False,
                              timeout=datetime.timedelta(seconds=config.parallel.tp_timeout_s))
        conn.send("joining")
        group = RankGroup(store, rank, size, device, config.parallel.tp_timeout_s)
        dtype = resolve_dtype(config, device)
        model, mc = load_model(config.model.name, dtype=dtype, device=device,
                               cache_dir=config.model.model_cache_dir, shard=Shard(rank, size))
        model.comm = group
        message = conn.recv()
        if message is None:
            return
        num_blocks, max_model_len, shared_pools = message
        cache = dataclasses.replace(config.cache, num_kv_blocks=num_blocks)
        shm = SharedMemoryPool() if shared_pools else None
        runner = ModelRunner(model, mc, dataclasses.replace(config, cache=cache), device, dtype,
                             shm, max_model_len=max_model_len)
        threading.Thread(target=serve_handoffs, args=(rank, runner, kv_conn, shm),
                         name="tp-handoffs", daemon=True).start()
        conn.send("ready")
        while (message := conn.recv()) is not None:
            follow_step(runner, *message)
    except EOFError:  # rank 0 is gone
        return
    except BaseException as e:
        with contextlib.suppress(OSError):
            conn.send(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise SystemExit(1) from e


@torch.inference_mode()
def follow_step(runner, step: StepInput, logits: bool,
                prompt_rows: list[tuple[int, int]] = ()) -> None:
    """Rank r's part of ModelRunner.run_step: the same forward on its shard (the same
    collectives in the same order), and its slice of the logits of each prompt_logprobs slice
    (prompt_rows, as RankWorkers.lead_step) and, when rank 0 samples, of the sampling rows."""
    from common.engine.model_runner import step_tensors

    input_ids, positions, meta = step_tensors(step, runner.device)
    if step.placeholder_dst:
        runner.model.comm.broadcast(input_ids)
    hidden = runner.model(input_ids, positions, runner.kv_cache, meta, runner.backend)
    for first, n in prompt_rows:
        runner.model.compute_logits(hidden[first:first + n])
    if logits:
        rows = step.logit_rows
        if len(rows) < step.num_tokens:
            hidden = hidden[torch.tensor(rows, dtype=torch.int64, device=runner.device)]
        runner.model.compute_logits(hidden)


if __name__ == "__main__":  # a rank > 0, started by RankWorkers
    logging.basicConfig(level=logging.INFO, format=f"tp-rank-{sys.argv[1]} %(message)s")
    from common.engine.parallel import rank_main as main  # the module, not this __main__ copy
    main(int(sys.argv[1]), int(sys.argv[2]), Connection(int(sys.argv[3])),
         Connection(int(sys.argv[4])))

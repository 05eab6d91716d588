"""Executes a SchedulerOutput: builds the flat batch, runs the model, samples (mechanism only).

The runner makes no policy decision; it turns "compute these tokens of these sequences" into
tensors, owns the KV pool, and returns for each sequence that caught up one sampled token, after
the draft tokens the target model accepted when the sequence speculated (verification: logits at
the last known token and at every draft, then common.spec_decode.rejection).

launch() returns before the device finishes (PendingStep); execute() is launch().result(). With
overlap scheduling the engine schedules step N+1 while step N runs, before N's tokens are on the
host: a sequence's last token is then a placeholder, -(1 + i), meaning "row i of the tokens the
previous launch sampled", and the runner copies it from there on the device.

launch() orders the scheduled sequences decodes first, builds their StepInput once
(common.engine.step_input) and hands both to run_step(), the one method a runner overrides:
ModelRunner.run_step makes fresh tensors of the input on the runner's device, runs the model
eagerly and samples (or verifies); common.engine.cuda_runner.CudaGraphRunner.run_step writes the
input into persistent buffers and replays CUDA graphs, and calls ModelRunner.run_step for the
steps it does not take. Each PendingStep names the path that ran it (`kind`); `steps` counts
launches by kind.

Step timing, for benchmarks: every callable in `step_listeners` is called after each launch with
a StepTiming (kind, and time.perf_counter() at launch()'s entry and return); timed_steps()
collects them in a list. It times the launch on the host (building and uploading the input,
enqueueing the forward and the sampler), not the step's completion: on CUDA the device may still
run it (or, with overlap scheduling, the step before it) when launch() returns; on the CPU the
forward runs inside launch(). With no listener it reads no clock and allocates nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import psutil
import torch

from common.engine.config import EngineConfig
from common.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from common.engine.core.sequence import Sequence
from common.engine.parallel import RankWorkers
from common.engine.sampler import DeviceSample, Sampler, TokenLogprobs
from common.engine.step_input import StepInput, build_step_input, decodes_first, step_rows
from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.fp8 import is_quantized, quantize_model
from common.models.model_config import ModelConfig
from common.models.ops_onednn import install_cpu_ops
from common.spec_decode.rejection import RejectionSampler

KVAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def default_kv_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Uninitialised: attention never reads a slot past a sequence's end (the reference ops and
    # kernels mask them), and a large CPU pool then costs memory only where it is used.
    return torch.empty(shape, dtype=dtype, device=device)


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from common.models.attention_triton import TritonAttentionBackend
        return TritonAttentionBackend()
    from common.models.attention_torch import TorchAttentionBackend
    return TorchAttentionBackend()


def step_tensors(step: StepInput, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids, positions and attention metadata of a step, as fresh tensors on `device`
    (placeholders still 0: see ModelRunner._fill_placeholders)."""
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(step.query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(step.block_tables, dtype=torch.int32,
                                  device=device).view(step.num_seqs, step.width),
        num_decodes=step.num_decodes,
        num_decode_tokens=step.num_decodes,
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
    )
    return (torch.tensor(step.input_ids, dtype=torch.int64, device=device),
            torch.tensor(step.positions, dtype=torch.int64, device=device), meta)


class StepOutput(NamedTuple):
    """The sequences that sampled this step (batch order) and what each of them got."""
    seqs: list[Sequence]
    token_ids: list[list[int]]  # per sequence: its accepted drafts, then one sampled token
    logprobs: list[list[TokenLogprobs] | None]  # per sequence, where it asked for them
    num_drafts: list[int]       # drafts verified per sequence (0: it did not speculate)
    num_accepted: list[int]     # of which accepted


class PendingStep:
    """A launched step. tokens: the sampled tokens on the device (one per sequence in seqs, the
    order placeholders refer to), or None for a verification step (its result is final). kind:
    the path that ran it, a key of the runner's `steps` ("eager" for ModelRunner.run_step).

    Deferred sampling (overlap scheduling with structured outputs): a constrained sequence whose
    last token is a placeholder cannot have its mask filled until its matcher has seen that
    token, i.e. until the engine has read the previous step. Its step is then launched up to its
    logits, and `sampling` samples them: the engine calls sample() once it has read the
    previous step (LLMEngine.step), and `tokens` or result() call it if nobody has."""

    def __init__(self, seqs: list[Sequence], sample: DeviceSample | None = None,
                 done: StepOutput | None = None, *, kind: str = "eager",
                 prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] | None = None,
                 sampling: Callable[[], DeviceSample] | None = None):
        self.seqs = seqs
        self._sample = sample
        self._sampling = sampling
        self._done = done
        self.kind = kind
        # prompt_logprobs: request id -> (prompt position, log-probability of its token) for the
        # positions this step computed the logits before (ModelRunner.prompt_logprobs).
        self.prompt_logprobs = prompt_logprobs or {}

    def sample(self) -> None:
        """Launch the deferred sampling (nothing if there is none, or it ran)."""
        if self._sampling is not None:
            sampling, self._sampling = self._sampling, None
            self._sample = sampling()

    @property
    def tokens(self) -> torch.Tensor | None:
        self.sample()
        return None if self._sample is None else self._sample.tokens

    def result(self) -> StepOutput:
        """Wait for the device and return the step's output (cached)."""
        self.sample()
        if self._done is None:
            if self._sample is None:
                self._done = StepOutput([], [], [], [], [])
            else:
                sampled = self._sample.result()
                n = len(self.seqs)
                self._done = StepOutput(self.seqs, [[t] for t in sampled.token_ids],
                                        [None if lp is None else [lp] for lp in sampled.logprobs],
                                        [0] * n, [0] * n)
        return self._done


class StepTiming(NamedTuple):
    """One launch, as step listeners hear of it (see the module docstring)."""
    kind: str     # the path that ran it (PendingStep.kind)
    start: float  # time.perf_counter() when launch() was entered
    end: float    # ... and when it returned: the step is launched, not necessarily done
    built: float = 0.0  # ... and when its input was built (the previous step's sampling, if
    #                     deferred, and build_step_input done; run_step from here to end)

    @property
    def seconds(self) -> float:
        return self.end - self.start


class ModelRunner:
    """`max_model_len`: the longest sequence the engine admits, as it resolved it
    (LLMEngine.max_model_len); block tables are at most that many tokens' blocks wide.
    `extra_bytes_per_block`: memory per block that another pool of the same number of blocks
    takes from the same budget (the draft model's KV, see common.spec_decode.draft_model)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype,
                 kv_cache_allocator: KVAllocator | None = None, *, max_model_len: int,
                 extra_bytes_per_block: int = 0):
        if config.model.quantization == "fp8" and not is_quantized(model):
            quantize_model(model)  # before the pool is sized from the memory left
        if device.type == "cpu":
            install_cpu_ops(model, config.model.cpu_linear)
        self.model = model
        self.mc = model_config
        self.config = config
        self.device = device
        self.dtype = dtype
        # --kv-cache-dtype fp8: e4m3 with scale 1.0 (kernels.kv_store), else the model's dtype
        self.kv_dtype = torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.backend = make_attention_backend(config.model.attention_backend, device)
        self.sampler = Sampler()
        self.verifier = RejectionSampler(self.sampler)
        self.extra_bytes_per_block = extra_bytes_per_block
        self.num_blocks = self._pool_size()
        self.last_step: PendingStep | None = None  # its tokens are what placeholders refer to
        self.ranks: RankWorkers | None = None  # the other tensor-parallel ranks (LLMEngine sets)
        self.steps: dict[str, int] = {"eager": 0}  # launches by PendingStep.kind
        self.step_listeners: list[Callable[[StepTiming], None]] = []
        # Called with a step's scheduled items once its forward is queued and before its
        # sampling: device work queued here is done when the step's tokens are read (the
        # engine queues the handoff checksums of held prompts: KVConnector.queue_checksum).
        self.after_forward: Callable[[list[ScheduledSeq]], None] | None = None
        shape = (model_config.num_layers, 2, self.num_blocks, self.block_size,
                 self.num_kv_heads, model_config.head_dim)
        self.kv_cache = (kv_cache_allocator or default_kv_allocator)(shape, self.kv_dtype, device)

    @property
    def num_kv_heads(self) -> int:
        """KV heads in this rank's pool (all of them at TP 1)."""
        layout = getattr(self.model, "layout", None)
        return self.mc.num_kv_heads if layout is None else layout.num_kv_heads

    @property
    def bytes_per_block(self) -> int:
        mc = self.mc
        return (2 * mc.num_layers * self.block_size * self.num_kv_heads * mc.head_dim
                * torch.empty((), dtype=self.kv_dtype).element_size())

    def _pool_size(self) -> int:
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.cache.kv_cache_memory_fraction
        else:
            cache = self.config.cache
            budget = min(cache.cpu_kv_cache_gib * 2**30,
                         psutil.virtual_memory().available * cache.kv_cache_memory_fraction)
        return max(1, int(budget // (self.bytes_per_block + self.extra_bytes_per_block)))

    @property
    def last_tokens(self) -> torch.Tensor | None:
        """The tokens the last launched step sampled, on the device (placeholders refer to
        them); reading them launches that step's deferred sampling if it has not run."""
        return None if self.last_step is None else self.last_step.tokens

    # ---- one step -----------------------------------------------------------------------------
    def _fill_placeholders(self, input_ids: torch.Tensor, dst: torch.Tensor,
                           src: torch.Tensor) -> None:
        if self.last_tokens is None:
            raise RuntimeError("a placeholder token, but the previous step sampled none")
        input_ids.index_copy_(0, dst, self.last_tokens.index_select(0, src))

    def execute(self, out: SchedulerOutput,
                draft_probs: Mapping[str, torch.Tensor] | None = None) -> StepOutput:
        """Run one step. draft_probs: request id -> [num drafts proposed, vocab], the proposal
        distribution of each draft token, for drafts that were sampled (absent: deterministic)."""
        return self.launch(out, draft_probs).result()

    def launch(self, out: SchedulerOutput,
               draft_probs: Mapping[str, torch.Tensor] | None = None) -> PendingStep:
        """execute() without waiting for the device: the step's input, built once, through
        run_step; step listeners hear of it."""
        timed = bool(self.step_listeners)
        start = time.perf_counter() if timed else 0.0
        if self.last_step is not None:  # a deferred sampling reads logits this step may reuse
            self.last_step.sample()
        items = decodes_first(out.scheduled)
        step = build_step_input(step_rows(items), self.block_size)
        built = time.perf_counter() if timed else 0.0
        pending = self.run_step(items, step, draft_probs or {})
        self.last_step = pending
        self.steps[pending.kind] += 1
        if timed:
            timing = StepTiming(pending.kind, start, time.perf_counter(), built)
            for listener in self.step_listeners:
                listener(timing)
        return pending

    @torch.inference_mode()
    def run_step(self, items: list[ScheduledSeq], step: StepInput,
                 draft_probs: Mapping[str, torch.Tensor]) -> PendingStep:
        """Launch one built step: the method runners override. items: the scheduled sequences
        in step order (decodes first); step: their input (build_step_input); draft_probs as in
        execute(). This one runs on fresh tensors on the runner's device, eagerly."""
        input_ids, positions, meta = step_tensors(step, self.device)
        if step.placeholder_dst:
            dev = self.device
            self._fill_placeholders(input_ids, torch.tensor(step.placeholder_dst, device=dev),
                                    torch.tensor(step.placeholder_src, device=dev))
        sampling = [s for s in items if s.samples]
        prompt_rows = prompt_logprob_rows(items, step)
        if self.ranks is not None:  # they run the same forward (common.engine.parallel)
            self.ranks.lead_step(step, input_ids, bool(sampling),
                                 [(first, n) for _, first, n in prompt_rows])
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend)
        if self.after_forward is not None:
            self.after_forward(items)
        prompt_lps = self.prompt_logprobs(items, prompt_rows, hidden)
        if not sampling:
            return PendingStep([], prompt_logprobs=prompt_lps)
        # Logit rows: each sampling sequence's last known token, then its drafts.
        rows = step.logit_rows
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[idx] if len(rows) < step.num_tokens else hidden)
        seqs = [s.seq for s in sampling]
        if not any(s.spec_token_ids for s in sampling):
            return self.sampled_step(seqs, logits, prompt_logprobs=prompt_lps)
        return PendingStep(seqs, done=self._verify(sampling, logits, draft_probs),
                           prompt_logprobs=prompt_lps)

    def sampled_step(self, seqs: list[Sequence], logits: torch.Tensor, **kw) -> PendingStep:
        """The PendingStep that samples `logits` (a row per sequence), now or, where a
        constrained sequence's last token is still a placeholder, deferred (see PendingStep);
        kw: PendingStep's keyword arguments."""
        previous = self.last_tokens
        if any(seq.grammar is not None and seq.token_ids[-1] < 0 for seq in seqs):
            return PendingStep(seqs, sampling=lambda: self._sample(logits, seqs, previous), **kw)
        return PendingStep(seqs, self._sample(logits, seqs, previous), **kw)

    @torch.inference_mode()  # a deferred sampling runs outside run_step's
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                previous: torch.Tensor | None) -> DeviceSample:
        return self.sampler.sample(logits, seqs, previous)

    def prompt_logprobs(self, items: list[ScheduledSeq], rows: list[tuple[int, int, int]],
                        hidden: torch.Tensor) -> dict[str, list[tuple[int, TokenLogprobs]]]:
        """For each sequence that asked for prompt_logprobs: the log-probability (float32
        log_softmax of the raw logits), rank and top-k of each prompt token whose logits this
        step computes (rows: prompt_logprob_rows). A host sync per step that has such a
        sequence; such steps run here, not in a graph. At TP > 1 the other ranks compute the
        same rows' logits in the same order (parallel.follow_step), each its vocabulary slice."""
        out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        for b, first, n in rows:
            seq, k = items[b].seq, items[b].seq.params.prompt_logprobs
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            logp = torch.log_softmax(self.model.compute_logits(hidden[first:first + n]), dim=-1)
            target = torch.tensor(seq.prompt_token_ids[start + 1:end + 1], dtype=torch.int64,
                                  device=logp.device)
            chosen = logp.gather(1, target[:, None])
            rank = (logp > chosen).sum(dim=1) + 1
            top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], target[:, None][:, :0])
            entries = zip(target.tolist(), chosen[:, 0].tolist(), rank.tolist(),
                          top_i.tolist(), top_v.tolist(), strict=True)
            out[seq.request_id] = [
                (start + 1 + j, TokenLogprobs(t, v, tuple(zip(ti, tv, strict=True)), r))
                for j, (t, v, r, ti, tv) in enumerate(entries)]
        return out

    @contextmanager
    def timed_steps(self) -> Iterator[list[StepTiming]]:
        """A StepTiming of every launch inside the block, in order (a step listener while it
        lasts)."""
        timings: list[StepTiming] = []
        listener = timings.append
        self.step_listeners.append(listener)
        try:
            yield timings
        finally:
            self.step_listeners.remove(listener)

    def _verify(self, sampling: list[ScheduledSeq], logits: torch.Tensor,
                draft_probs: Mapping[str, torch.Tensor]) -> StepOutput:
        """Sequences without drafts go through the plain sampler, the others through the
        rejection sampler; logits holds 1 + len(drafts) rows per sequence, in order."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        offset = 0
        for s in sampling:
            n = 1 + len(s.spec_token_ids)
            (spec_rows if s.spec_token_ids else plain_rows).extend(range(offset, offset + n))
            offset += n
        n = len(sampling)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprobs] | None] = [None] * n
        num_drafts, num_accepted = [0] * n, [0] * n
        plain = [i for i, s in enumerate(sampling) if not s.spec_token_ids]
        if plain:
            rows = torch.tensor(plain_rows, dtype=torch.int64, device=self.device)
            sampled = self.sampler(logits[rows], [sampling[i].seq for i in plain])
            for i, t, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
                token_ids[i] = [t]
                logprobs[i] = None if lp is None else [lp]
        spec = [i for i, s in enumerate(sampling) if s.spec_token_ids]
        drafts = [sampling[i].spec_token_ids for i in spec]
        probs = [draft_probs.get(sampling[i].seq.request_id) for i in spec]
        rows = torch.tensor(spec_rows, dtype=torch.int64, device=self.device)
        verified = self.verifier(logits[rows], [sampling[i].seq for i in spec], drafts,
                                 [None if q is None else q[:len(d)]
                                  for q, d in zip(probs, drafts, strict=True)])
        for i, d, tokens, a in zip(spec, drafts, verified.token_ids, verified.num_accepted,
                                   strict=True):
            token_ids[i], num_drafts[i], num_accepted[i] = tokens, len(d), a
        return StepOutput([s.seq for s in sampling], token_ids, logprobs, num_drafts,
                          num_accepted)

    # ---- KV blocks in and out (handoff) -------------------------------------------------------
    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        return gather_blocks(self.kv_cache, block_ids, use_kernel=self.device.type == "cuda")

    def import_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Writes kv, shaped as export_kv returns it, into the blocks."""
        scatter_blocks(self.kv_cache, block_ids, kv, use_kernel=self.device.type == "cuda")


def prompt_logprob_rows(items: list[ScheduledSeq], step: StepInput,
                        ) -> list[tuple[int, int, int]]:
    """(item, first row, rows) for each sequence that asked for prompt_logprobs and whose
    prompt tokens this step computes: row p of its chunk gives the logprob of prompt token
    p + 1, so every prompt row but the last:

        prompt:   | t0 t1 t2 t3 t4 |          this chunk computes rows p = 2, 3
        rows:           | 2  3 |           -> logprobs of t3 (position 3) and t4 (position 4)
    """
    out = []
    for b, s in enumerate(items):
        seq = s.seq
        start = seq.num_computed_tokens
        end = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
        if seq.params.prompt_logprobs is not None and end > start:
            out.append((b, step.query_start_loc[b], end - start))
    return out


def gather_blocks(pool: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
                  block_ids: list[int], *, use_kernel: bool,
                  ) -> torch.Tensor:   # [layers, 2, len(block_ids), block_size, kv_heads, head_dim]
    """pool[:, :, block_ids] as a new tensor. use_kernel: through kernels.block_copy, the CUDA
    path (index_select on dim 2 ran at 15% of copy bandwidth on the H200, the kernel at 94%);
    otherwise index_select, the CPU path."""
    if not use_kernel:
        _check_block_ids(block_ids, pool)
        return pool.index_select(2, torch.tensor(block_ids, dtype=torch.int64,
                                                 device=pool.device))
    from kernels.block_copy import copy_listed_blocks
    out = pool.new_empty((*pool.shape[:2], len(block_ids), *pool.shape[3:]))
    copy_listed_blocks(pool, out, block_ids, range(len(block_ids)), block_dim=2)
    return out


def scatter_blocks(pool: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
                   block_ids: list[int],  # distinct
                   kv: torch.Tensor,  # [layers, 2, len(block_ids), block_size, kv_heads, head_dim]
                   *, use_kernel: bool) -> None:
    """pool[:, :, block_ids] = kv (converted to the pool's device and dtype); use_kernel as in
    gather_blocks."""
    kv = kv.to(device=pool.device, dtype=pool.dtype)
    if not use_kernel:
        _check_block_ids(block_ids, pool)
        if pool.dtype == torch.float8_e4m3fn:  # no fp8 index_copy_ on CPU: copy the bytes
            pool, kv = pool.view(torch.uint8), kv.view(torch.uint8)
        pool.index_copy_(2, torch.tensor(block_ids, dtype=torch.int64, device=pool.device), kv)
        return
    from kernels.block_copy import copy_listed_blocks
    want = (*pool.shape[:2], len(block_ids), *pool.shape[3:])
    if tuple(kv.shape) != want:
        raise ValueError(f"kv {tuple(kv.shape)} does not hold {len(block_ids)} blocks of the pool "
                         f"{tuple(pool.shape)}")
    copy_listed_blocks(kv.contiguous(), pool, range(len(block_ids)), block_ids, block_dim=2)


def _check_block_ids(block_ids: list[int], pool: torch.Tensor) -> None:
    """On the host: on CUDA index_select would fail later, asynchronously, with a device-side
    assert that poisons the process's context."""
    if block_ids and not 0 <= min(block_ids) <= max(block_ids) < pool.shape[2]:
        raise IndexError(f"block ids outside [0, {pool.shape[2]})")

"""The GPU execution path: a ModelRunner whose step allocates nothing and replays CUDA graphs.

At start-up it allocates every per-step tensor (input ids, positions, slot mapping, query start
locations, context lengths, block tables, logit row indices) on the device at its largest size,
with pinned host twins, and captures one CUDA graph per decode batch bucket and per prefill/mixed
shape. It overrides ModelRunner.run_step, which gets the step's input as ModelRunner.launch
built it (common.engine.step_input.StepInput); a step then:

    StepInput lists --> pinned staging --(one non_blocking copy per buffer)--> persistent buffers
    decode-only and fits a bucket: pad the step to the bucket (padded_for_decode_graph) and
                                   replay its graph (padding rows: token 0, position 0, slot -1,
                                   context 0)
    fits a prefill/mixed graph:    pad its tokens and rows (padded_for_prefill_graph), replay
    otherwise (prefill, mixed):    eager forward on views of the same buffers
    logits of the rows that sample --> Sampler (on the GPU) --> tokens copied to pinned memory
    PendingStep.result(): waits for that copy, the step's one sync (overlap scheduling builds
    and launches the next step first; its placeholder tokens are copied on the device)

Padding rows write no K/V (slot -1 is skipped) and their attention output is zeros (context 0);
their logits are never read. On CUDA the element-wise ops are kernels' Triton kernels
(common.models.ops_triton) and attention is the "triton" backend unless the config names "torch";
graphs need the triton backend (the torch one reads seq_lens on the host). Off CUDA the same
buffer logic runs eagerly, which is how the CPU tests check it against ModelRunner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from common.engine.config import EngineConfig
from common.engine.core.scheduler import ScheduledSeq
from common.engine.model_runner import KVAllocator, ModelRunner, PendingStep
from common.engine.step_input import StepInput
from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.model_config import ModelConfig

SMALL_BUCKETS = (1, 2, 4, 8, 16, 32)
BUCKET_STEP = 32  # above 32 rows, buckets every 32 rows: at most 31 padding rows per step


def decode_buckets(max_batch: int) -> list[int]:
    """Graph batch sizes: 1, 2, 4, ..., 32, then every 32 up to max_batch (always included)."""
    sizes = {b for b in SMALL_BUCKETS if b < max_batch}
    sizes.update(range(BUCKET_STEP * 2, max_batch, BUCKET_STEP))
    sizes.add(max_batch)
    return sorted(sizes)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts of the prefill/mixed graphs: 16, 32, ..., 256, then every 128 up to
    max_tokens (0: none)."""
    sizes = [t for t in (16, 32, 64, 128, 256) if t < max_tokens]
    sizes += range(384, max_tokens, 128)
    return sorted({*sizes, max_tokens}) if max_tokens > 0 else []


PREFILL_GRAPH_FEW_SEQS = 16  # the small sequence bucket of the prefill graphs


def prefill_graph_shapes(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the prefill/mixed graphs. Two sequence buckets: the extend kernel
    runs a program per query tile plus one per sequence row, each locating its sequence by a
    binary search over the rows, so padding a 1-sequence step to max_seqs rows costs it more
    than the attention itself (measured 45 vs 24 us per layer for 100 new tokens)."""
    seqs = sorted({min(PREFILL_GRAPH_FEW_SEQS, max_seqs), max_seqs})
    return [(t, s) for t in prefill_buckets(max_tokens) for s in seqs if s <= t or s == seqs[0]]


def make_runner(model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                device: torch.device, dtype: torch.dtype,
                kv_cache_allocator: KVAllocator | None = None, *, max_model_len: int,
                extra_bytes_per_block: int = 0) -> ModelRunner:
    """The engine's runner: CudaGraphRunner on CUDA, the plain ModelRunner elsewhere."""
    cls = CudaGraphRunner if device.type == "cuda" else ModelRunner
    return cls(model, model_config, config, device, dtype, kv_cache_allocator,
               max_model_len=max_model_len, extra_bytes_per_block=extra_bytes_per_block)


class _Staged:
    """A persistent device buffer and its (pinned, on CUDA) host twin, same shape. The host
    twin is written through a numpy view of its memory: a list goes in without a tensor made of
    it (a step writes nine of them on the engine thread, between other threads' turns at the
    GIL)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(shape, dtype=dtype, device=device)

    def put(self, values: list[int], n: int | None = None) -> torch.Tensor:
        """Write values to host[:len], copy host[:n] (default len) up; the device view [:n]."""
        self.host_np[:len(values)] = values
        n = len(values) if n is None else n
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    # Written by each replay. Decode: [bucket, vocab] logits in the model's dtype; prefill:
    # [tokens, hidden].
    output: torch.Tensor


class CudaGraphRunner(ModelRunner):
    """ModelRunner's API (execute, kv_cache, num_blocks, export_kv, import_kv, sampler) with
    persistent buffers and CUDA graphs. Three kinds of step go to ModelRunner.run_step instead
    (kind "fallback"): speculative verification steps (drafts), steps with a sequence that asked
    for prompt_logprobs (they need every prompt row's logits), and steps larger than the
    buffers (more sequences than max_num_seqs, e.g. handed-off requests, or tables past
    max_model_len). Step kinds: "graph" (a decode graph), "prefill_graph", "eager" (the
    buffers, no graph) and "fallback"."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype,
                 kv_cache_allocator: KVAllocator | None = None, *, max_model_len: int,
                 extra_bytes_per_block: int = 0, use_cuda_graphs: bool = True):
        super().__init__(model, model_config, config, device, dtype, kv_cache_allocator,
                         max_model_len=max_model_len, extra_bytes_per_block=extra_bytes_per_block)
        if device.type == "cuda":
            from common.models.ops_triton import TRITON_OPS
            model.ops = TRITON_OPS
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_seqs = config.scheduler.max_num_seqs
        self.max_tokens = max(config.scheduler.max_num_batched_tokens, self.max_seqs)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = _Staged((self.max_tokens,), i64, device)
        self.positions = _Staged((self.max_tokens,), i64, device)
        self.slot_mapping = _Staged((self.max_tokens,), i64, device)
        self.query_start_loc = _Staged((self.max_seqs + 1,), i32, device)
        self.seq_lens = _Staged((self.max_seqs,), i32, device)
        self.block_tables = _Staged((self.max_seqs, self.max_blocks), i32, device)
        self.logit_rows = _Staged((self.max_seqs,), i64, device)
        self.placeholder_dst = _Staged((self.max_seqs,), i64, device)
        self.placeholder_src = _Staged((self.max_seqs,), i64, device)
        # Recorded after each step's uploads: the next step waits on it before it rewrites the
        # pinned staging (a no-op wait when the previous step's .tolist() already synced).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.graphs: dict[int, _Graph] = {}  # decode-only steps, by batch size
        self._workspaces: list = []  # decode split partials the graphs write
        # Prefill / mixed steps, by token count: below ~1k tokens an eager 8B-shape step costs
        # more in launches (~300 of them) than on the GPU. Every sequence row up to max_seqs is
        # in the graph (unused ones have no tokens), and all rows go through the extend kernel.
        self.prefill_graphs: dict[tuple[int, int], _Graph] = {}  # by (tokens, sequences)
        self.prefill_graph_tokens = min(config.cuda_graphs.prefill_tokens, self.max_tokens)
        self.steps = {"graph": 0, "prefill_graph": 0, "eager": 0, "fallback": 0}
        if use_cuda_graphs and device.type == "cuda" and self.backend.name == "triton":
            self._capture_all()

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def run_step(self, items: list[ScheduledSeq], step: StepInput,
                 draft_probs: Mapping[str, torch.Tensor]) -> PendingStep:
        """The step on the persistent buffers: a graph replay where one fits, else eager."""
        if (step.num_seqs > self.max_seqs or step.num_tokens > self.max_tokens
                or step.width > self.max_blocks or any(s.spec_token_ids for s in items)
                or any(s.seq.params.prompt_logprobs is not None for s in items)):
            pending = super().run_step(items, step, draft_probs)
            pending.kind = "fallback"
            return pending
        if self._uploaded is not None:
            self._uploaded.synchronize()
        n, num_tokens = step.num_seqs, step.num_tokens
        bucket = self.bucket_for(n) if num_tokens == n else None  # decode only
        prefill_bucket = (next((key for key in sorted(self.prefill_graphs)
                                if key[0] >= num_tokens and key[1] >= n), None)
                          if bucket is None else None)
        if bucket is not None:
            kind, logits = "graph", self._replay(step, bucket)
        elif prefill_bucket is not None:
            kind, logits = "prefill_graph", self._replay_prefill(step, prefill_bucket)
        else:
            kind, logits = "eager", self._eager(step)
        if self.after_forward is not None:
            self.after_forward(items)
        if logits is None:
            return PendingStep([], kind=kind)
        seqs = [s.seq for s in items if s.samples]
        return self.sampled_step(seqs, logits, kind=kind)

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size that holds n rows (None: no graph fits)."""
        return next((b for b in sorted(self.graphs) if b >= n), None)

    def _stage(self, step: StepInput) -> AttentionMetadata:
        """Writes a step input, padded or not, into the persistent buffers: each list into its
        pinned host twin, one non_blocking copy up per buffer, then the placeholders' tokens
        copied on the device. Returns the metadata on the device buffers (the eager path's;
        the graphs have their own)."""
        n, rows, width = step.num_seqs, len(step.seq_lens), step.width
        # Whole rows go up (one contiguous copy). Entries past `width`, and the padding rows,
        # are stale but valid block ids, and the kernels read no token past seq_lens, so they
        # are never used.
        self.block_tables.host_np[:n, :width] = np.asarray(
            step.block_tables, dtype=np.int32).reshape(n, width)
        self.block_tables.dev[:rows].copy_(self.block_tables.host[:rows], non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.put(step.slot_mapping),
            query_start_loc=self.query_start_loc.put(step.query_start_loc),
            seq_lens=self.seq_lens.put(step.seq_lens),
            block_tables=self.block_tables.dev[:rows, :width],
            num_decodes=step.num_decodes, num_decode_tokens=step.num_decodes,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        self.input_ids.put(step.input_ids)
        self.positions.put(step.positions)
        if step.placeholder_dst:
            self._fill_placeholders(self.input_ids.dev,
                                    self.placeholder_dst.put(step.placeholder_dst),
                                    self.placeholder_src.put(step.placeholder_src))
        return meta

    def _replay_prefill(self, step: StepInput, shape: tuple[int, int]) -> torch.Tensor | None:
        # Rows of the block table past the step's keep stale ids: their sequences have no
        # tokens and seq_len 0, so nothing reads them.
        tokens, seqs = shape
        self._stage(step.padded_for_prefill_graph(tokens, seqs))  # the graph has its meta
        rows = self.logit_rows.put(step.logit_rows) if step.logit_rows else None
        self._record_upload()
        g = self.prefill_graphs[shape]
        g.graph.replay()
        if rows is None:
            return None
        return self.model.compute_logits(g.output.index_select(0, rows))

    def _eager(self, step: StepInput) -> torch.Tensor | None:
        meta = self._stage(step)
        num_tokens = step.num_tokens
        rows = self.logit_rows.put(step.logit_rows)
        self._record_upload()
        hidden = self.model(self.input_ids.dev[:num_tokens], self.positions.dev[:num_tokens],
                            self.kv_cache, meta, self.backend)
        if not step.logit_rows:
            return None
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _replay(self, step: StepInput, bucket: int) -> torch.Tensor | None:
        # The graph reads block_tables.dev[:bucket], all columns. Decode rows: row == token.
        self._stage(step.padded_for_decode_graph(bucket))
        sampling = step.logit_rows
        rows = self.logit_rows.put(sampling) if len(sampling) < step.num_seqs else None
        self._record_upload()
        g = self.graphs[bucket]
        g.graph.replay()
        if not sampling:
            return None
        return g.output[:step.num_seqs] if rows is None else g.output.index_select(0, rows)

    def _record_upload(self) -> None:
        if self._uploaded is not None:
            self._uploaded.record()

    # ---- CUDA graphs --------------------------------------------------------------------------
    def _decode_forward(self, bucket: int, backend: AttentionBackend) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.dev[:bucket],
            query_start_loc=self.query_start_loc.dev[:bucket + 1],
            seq_lens=self.seq_lens.dev[:bucket],
            block_tables=self.block_tables.dev[:bucket],
            num_decodes=bucket, num_decode_tokens=bucket, max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size)
        hidden = self.model(self.input_ids.dev[:bucket], self.positions.dev[:bucket],
                            self.kv_cache, meta, backend)
        # In the model's dtype: a greedy batch takes their argmax as they are (no float32 copy
        # of [bucket, vocab] in the graph); the sampler upcasts when it computes with them.
        return self.model.compute_logits(hidden, upcast=False)

    def _prefill_forward(self, tokens: int, s: int, backend: AttentionBackend) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.dev[:tokens],
            query_start_loc=self.query_start_loc.dev[:s + 1],
            seq_lens=self.seq_lens.dev[:s],
            block_tables=self.block_tables.dev[:s],
            num_decodes=0, num_decode_tokens=0, max_query_len=tokens,
            max_seq_len=self.max_blocks * self.block_size)
        return self.model(self.input_ids.dev[:tokens], self.positions.dev[:tokens],
                          self.kv_cache, meta, backend)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """One graph per bucket, largest first so the smaller ones reuse its memory pool."""
        from common.models.attention_triton import TritonAttentionBackend
        from kernels.decode_attention import DecodeConfig, DecodeWorkspace, default_num_splits

        biggest = decode_buckets(self.max_seqs)[-1]
        # Capture-time inputs: every row is padding (writes nothing, reads nothing).
        self.slot_mapping.dev[:biggest].fill_(-1)
        self.seq_lens.dev[:biggest].fill_(0)
        pool = None
        # Prefill graphs first (the largest activations); capture-time inputs: no sequence has a
        # token (query_start_loc all 0), every token slot is -1.
        self.slot_mapping.dev.fill_(-1)
        self.query_start_loc.dev.zero_()
        prefill_backend = TritonAttentionBackend()
        for tokens, seqs in reversed(prefill_graph_shapes(self.prefill_graph_tokens,
                                                          self.max_seqs)):
            self._prefill_forward(tokens, seqs, prefill_backend)  # compiles outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._prefill_forward(tokens, seqs, prefill_backend)
            pool = graph.pool()
            self.prefill_graphs[tokens, seqs] = _Graph(graph, hidden)
        self.query_start_loc.dev[:biggest + 1].copy_(
            torch.arange(biggest + 1, dtype=torch.int32, device=self.device))
        for bucket in reversed(decode_buckets(self.max_seqs)):
            # A fixed split count per bucket: the launch grid must not change between replays.
            config = DecodeConfig.for_batch(bucket, self.mc.num_kv_heads, self.device,
                                            fp8=self.kv_dtype == torch.float8_e4m3fn)
            splits = default_num_splits(bucket, self.mc.num_kv_heads,
                                        self.max_blocks * self.block_size, self.device, config)
            # The split partials live outside the graphs' pool, one workspace per bucket, shared
            # by its layers; the runner keeps them as long as the graphs.
            workspace = (DecodeWorkspace.allocate(bucket, self.mc.num_heads, self.mc.head_dim,
                                                  splits, self.device) if splits > 1 else None)
            self._workspaces.append(workspace)
            backend = TritonAttentionBackend(decode_splits=splits, decode_config=config,
                                             decode_workspace=workspace)
            self._decode_forward(bucket, backend)  # compiles the kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._decode_forward(bucket, backend)
            pool = graph.pool()
            self.graphs[bucket] = _Graph(graph, logits)
        torch.cuda.synchronize(self.device)

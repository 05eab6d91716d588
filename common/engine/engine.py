"""The in-process engine: requests in, streamed tokens out, one scheduler step at a time.

    add_request() -> Scheduler.waiting -> step(): [propose drafts] -> schedule
                  -> ModelRunner.execute (sample / verify) -> stop checks / detokenize
                  -> Scheduler.update -> RequestOutput deltas

Not thread-safe: services drive it from a single thread (common/serving/engine_loop.py).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import torch

from common.engine.config import EngineConfig
from common.engine.core.block_manager import BlockManager
from common.engine.core.sampling_params import SamplingParams
from common.engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from common.engine.core.sequence import FinishReason, Sequence
from common.engine.cuda_runner import make_runner
from common.engine.kv_connector import KVConnector
from common.engine.model_runner import KVAllocator, ModelRunner, PendingStep
from common.engine.parallel import RankWorkers, threads_per_rank
from common.engine.sampler import TokenLogprobs
from common.engine.structured import GrammarCache, GrammarState
from common.errors import InvalidRequestError, SplitserveError
from common.kv_transport.shm import SharedMemoryPool
from common.models.loader import load_model, model_config, resolve_model
from common.models.sharding import Shard, shard_layout
from common.spec_decode.draft_model import kv_bytes_per_block, load_draft_model
from common.spec_decode.speculator import SpecDecodeCounters, make_speculator
from common.text.detokenizer import IncrementalDetokenizer, StopChecker
from common.text.tokenizer import Tokenizer

log = logging.getLogger("splitserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class Prefilled:
    """A request whose first token was sampled upstream (by a prefill service). block_ids: the
    blocks holding the prompt's KV (reserved with kv.reserve and filled by the transport),
    or None when the KV could not be brought over and is recomputed here. Either way the first
    token is an output (stop strings, penalties, seeds, min/max tokens see it)."""
    block_ids: list[int] | None
    first_token_id: int


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics
    # The sequence's own output list and how many of its tokens this output covers: the list
    # only grows (and only a trailing placeholder past that count changes), so its first
    # `_num_outputs` entries stay this output's tokens, and no step copies every stream's
    # whole output (which grew quadratically with the output length).
    _outputs: list[int]
    _num_outputs: int
    held_block_ids: list[int] | None = None
    block_hashes: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    text: str = ""  # all output text so far
    # Set on a finished output when the request failed after it was added (its structured
    # output's grammar was refused): the caller reports this error instead of the output.
    error: SplitserveError | None = None
    # n > 1: the choice this output belongs to (request_id is the request's for every choice),
    # and whether it is the request's last output (its last unfinished choice finished). With
    # n == 1, index 0 and last == finished.
    index: int = 0
    last: bool = False
    # prompt_logprobs: one entry per prompt token (None for the first), on the first output.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """Every output token so far (a new list each call)."""
        return self._outputs[:self._num_outputs]


@dataclass(slots=True)
class _Text:
    """Per-request text state: incremental detokenizer plus stop-string matcher."""
    detok: IncrementalDetokenizer
    stops: StopChecker
    raw: str = ""   # everything detokenized so far
    text: str = ""  # what was emitted (stop strings cut, a possible stop prefix held back)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.model.dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_cache_allocator: KVAllocator | None = None,
                 runner_factory: Callable[..., ModelRunner] = make_runner):
        """runner_factory builds the model runner (default: CUDA graphs on CUDA, the plain runner
        elsewhere); tests pass a runner class to compare runners on the same device."""
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config, self.device)
        self._cuda_index = self.device.index if self.device.type == "cuda" else None
        if self._cuda_index is None and self.device.type == "cuda":
            self._cuda_index = torch.cuda.current_device()
            self.device = torch.device("cuda", self._cuda_index)
        self._use_device()
        torch.manual_seed(config.model.seed)
        tp = config.parallel.tensor_parallel_size
        if (config.model.cpu_threads or tp > 1) and self.device.type == "cpu":
            torch.set_num_threads(threads_per_rank(config))
        cache_dir = config.model.model_cache_dir
        self.ranks: RankWorkers | None = None
        if tp > 1:  # a size that does not divide the model fails here, before any rank starts
            shard_layout(model_config(config.model.name, cache_dir), Shard(0, tp))
            self.ranks = RankWorkers(config, self.device)
            weakref.finalize(self, self.ranks.close)
            if runner_factory is make_runner:  # CUDA graphs are not yet taken on every rank
                runner_factory = ModelRunner
        self.model, self.model_config = load_model(
            config.model.name, dtype=self.dtype, device=self.device, cache_dir=cache_dir,
            shard=Shard(0, tp))
        if self.ranks is not None:
            self.model.comm = self.ranks.group
        self.tokenizer: Tokenizer | None = None
        if not config.model.is_dummy:
            self.tokenizer = Tokenizer.from_dir(resolve_model(config.model.name, cache_dir))
        mc = self.model_config
        self.max_model_len = config.scheduler.resolved_max_model_len(mc.max_position_embeddings)
        draft_model = None
        draft_bytes = 0
        if config.speculative.method == "draft":  # loaded first: its weights are not KV memory
            draft_model, draft_mc = load_draft_model(config, mc, self.dtype, self.device)
            draft_bytes = kv_bytes_per_block(draft_mc, config.cache.block_size, self.dtype)
        self.runner = runner_factory(self.model, mc, config, self.device, self.dtype,
                                     kv_cache_allocator, max_model_len=self.max_model_len,
                                     extra_bytes_per_block=draft_bytes)
        if self.ranks is not None:
            self.runner.ranks = self.ranks
            self.ranks.start_runners(self.runner.num_blocks, self.max_model_len,
                                     shared_pools=isinstance(kv_cache_allocator, SharedMemoryPool))
        self.speculator = make_speculator(config, self.max_model_len,
                                          num_blocks=self.runner.num_blocks,
                                          backend=self.runner.backend, draft_model=draft_model)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        # Blocks outside any running sequence: held for a handoff, or reserved for one.
        self.kv = KVConnector(self.block_manager, self.runner, self._cuda_index,
                              self.step_in_flight_may_write_free_blocks, self._use_device)
        if self._cuda_index is not None:
            self.runner.after_forward = self._queue_handoff_checksums
        self.eos_token_ids = (self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self._choices: dict[str, list[str]] = {}  # n > 1: a request's id -> its forks' ids
        self.texts: dict[str, _Text] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step()
        # Structured outputs (common/engine/structured.py): grammars compile off this thread;
        # `wakeup` (set by the engine's driver, e.g. EngineLoop) is called when one is done.
        self.grammars = (GrammarCache(self.tokenizer, mc.vocab_size, self.eos_token_ids)
                         if self.tokenizer is not None else None)
        if self.grammars is not None and config.model.grammar_warmup:
            self.grammars.warm_up()
        self._compiling: list[Sequence] = []
        self.wakeup: Callable[[], None] | None = None
        # Overlap scheduling (see step()); speculation proposes from the real last tokens.
        self.overlap = self.speculator is None and (
            config.scheduler.overlap_scheduling == "on"
            or (config.scheduler.overlap_scheduling == "auto" and self.device.type == "cuda"))
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        log.info("engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d",
                 config.model_name, self.device, self.dtype, self.runner.num_blocks,
                 config.cache.block_size)

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (nothing at TP 1); the engine cannot step after."""
        if self.ranks is not None:
            self.ranks.close()

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def spec_counters(self) -> SpecDecodeCounters:
        """Speculative decoding totals (all zero when it is off)."""
        return self.speculator.counters if self.speculator else SpecDecodeCounters()

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model's context length ({self.max_model_len})")
        needed = -(-(len(prompt_token_ids) + params.max_tokens) // self.config.cache.block_size)
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"request needs {needed} KV blocks; the pool has {self.block_manager.num_blocks}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefilled: Prefilled | None = None, arrival_time: float | None = None,
                    output_token_ids: Seq[int] = (), hold_kv: bool = False) -> None:
        """hold_kv: keep the request's blocks when it finishes, under its id in kv.held, until
        kv.release (a prefill service hands them off). output_token_ids: outputs generated and delivered before, elsewhere (a migrated
        request's continuation). They count as outputs (max/min tokens, stop rules, penalties,
        seeded draws) and their KV is computed with the prompt's; prefilled's first token
        follows them, and prefilled.block_ids then hold the KV of the prompt and of them."""
        if request_id in self.seqs or request_id in self.kv.held:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in output_token_ids):
            raise InvalidRequestError(f"output token ids must be in [0, {vocab})")
        seq = Sequence(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                       arrival_time=arrival_time or time.monotonic(), hold_kv=hold_kv)
        if params.structured is not None:
            seq.grammar = self._grammar_state(params)
        if params.prompt_logprobs is not None and prefilled is None and not output_token_ids:
            seq.prompt_logprobs = [None] * len(prompt_token_ids)  # filled as it is computed
        self._add_text(seq)
        known = list(output_token_ids)
        if prefilled is not None:
            if prefilled.block_ids is not None:
                computed = len(prompt_token_ids) + len(known)
                if len(prefilled.block_ids) * self.config.cache.block_size < computed:
                    raise InvalidRequestError("prefilled blocks are too few for the prompt")
                seq.block_table = list(prefilled.block_ids)
                seq.num_computed_tokens = computed
                seq.first_scheduled_time = seq.arrival_time
            known.append(prefilled.first_token_id)
        reason = None
        for token in known:
            _, reason = self._append(seq, token)
            if reason is not None:
                break
        if prefilled is not None:  # its first token came out upstream
            seq.first_token_time = seq.arrival_time
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        if seq.grammar is not None and not seq.grammar.ready:
            self._compiling.append(seq)
        if seq.num_output_tokens and params.n > 1:  # prefilled upstream: fork at once
            self._fork(seq)
        if reason is not None:  # a known token already ended it: report at the next step
            self._finish(seq, reason)
            self._pending.append(self._output(seq, [], "", None, time.monotonic()))

    def _add_text(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self.texts[seq.request_id] = _Text(
                IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                       seq.params.skip_special_tokens),
                StopChecker(seq.params.stop, seq.params.include_stop_str_in_output))

    def _fork(self, parent: Sequence) -> None:
        """n > 1, once parent (choice 0) has its first token: the other n - 1 choices, each
        sharing parent's computed full prompt blocks (Scheduler.fork) and sampling its own first
        token with seed + index. Their outputs carry parent's request id and their index."""
        params, parent.params = parent.params, parent.params.choice(0)
        ids = self._choices[parent.request_id] = []
        for i in range(1, params.n):
            child = self.scheduler.fork(parent, f"{parent.request_id}#{i}", params.choice(i), i)
            if params.structured is not None:
                child.grammar = self._grammar_state(child.params)
                if not child.grammar.ready:
                    self._compiling.append(child)
            self._add_text(child)
            self.seqs[child.request_id] = child
            ids.append(child.request_id)

    def _grammar_state(self, params: SamplingParams) -> GrammarState:
        """The request's matcher state, active at once when its grammar is cached (a refused
        one raises its InvalidRequestError here); else it waits for the compile (see step())."""
        if self.grammars is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer")
        future = self.grammars.get(params.structured, self._wake)
        state = GrammarState(future, self.eos_token_ids)
        if future.done():
            state.activate([])  # the known outputs are fed as they are appended
        return state

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup()

    def _activate_compiled(self) -> None:
        """Sequences whose grammar finished compiling get their matcher (fed every output they
        have), or end: with the parser's error if the spec was refused, with reason "grammar"
        if their delivered outputs break it."""
        waiting = []
        for seq in self._compiling:
            if seq.is_finished:
                continue
            if not seq.grammar.future.done():
                waiting.append(seq)
                continue
            error = None
            try:
                fits = seq.grammar.activate(seq.output_token_ids)
            except InvalidRequestError as e:
                fits, error = False, e
            if not fits:
                self._finish(seq, FinishReason.ABORT if error else FinishReason.GRAMMAR)
                out = self._output(seq, [], "", None, time.monotonic())
                out.error = error
                self._pending.append(out)
        self._compiling = waiting

    def abort(self, request_id: str) -> bool:
        """Abort a request, every choice of it, or release its handoff hold."""
        if self.kv.release(request_id):
            return True
        found = False
        for sid in [request_id, *self._choices.pop(request_id, ())]:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                self.scheduler.finish(seq, FinishReason.ABORT)
                self._forget(sid)
                found = True
        return found

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending)
                or self._in_flight is not None)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- blocks across services (see kv_connector.py) ---------------------------------------
    def step_in_flight_may_write_free_blocks(self) -> bool:
        """Whether the step in flight (overlap scheduling) may still write blocks that are free.

        Between steps only the last launched step can be running (the outputs of the ones before
        it have been read), and it writes only blocks of its own sequences. Those are free only
        if their sequence has finished or been aborted since the step was launched (overlap: a
        sequence ended by the step before still has a wasted row in it). So when none of its
        sequences has, no free block is written any more, and a copy into freshly reserved
        blocks need not wait for the step."""
        return self._in_flight is not None and any(
            s.seq.is_finished for s in self._in_flight[0].scheduled)

    def _use_device(self) -> None:
        """Make the engine's GPU the calling thread's current device: Triton launches and CUDA
        graph replays go to the current device, and each thread has its own (services step the
        engine on a thread of their own, and pull KV on others)."""
        if self._cuda_index is not None and torch.cuda.current_device() != self._cuda_index:
            torch.cuda.set_device(self._cuda_index)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step: schedule, launch on the device, return outputs.

        Synchronous, the step's own outputs come back. With overlap scheduling the previous
        step is finished (its tokens read, stop rules, outputs) after this one is launched,
        while the device runs it, so outputs arrive one step() later; until then a sequence
        that sampled in the step in flight carries a placeholder for that token (see
        common.engine.model_runner), which the runner reads on the device.
        """
        self._use_device()
        if self._compiling:
            self._activate_compiled()
        outputs, self._pending = self._pending, []
        launched = self._launch()
        if not self.overlap:
            if launched is not None:
                outputs += self._finish_step(*launched)
            return outputs
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            outputs += self._finish_step(*previous)
        if launched is not None:
            out, pending = launched
            pending.sample()  # deferred until the matchers saw the step just read (PendingStep)
            self.scheduler.update(out)  # the next schedule() must see this step as computed
            self._add_placeholders(pending)
            self._in_flight = launched
        return outputs

    def _launch(self) -> tuple[SchedulerOutput, PendingStep] | None:
        draft_probs = self.speculator.propose(self.scheduler.running) if self.speculator else {}
        out = self.scheduler.schedule()
        if self.speculator:
            for seq in out.preempted:
                self.speculator.forget(seq.request_id)
        if out.is_empty:
            return None
        return out, self.runner.launch(out, draft_probs)

    def _queue_handoff_checksums(self, items: list[ScheduledSeq]) -> None:
        """The runner's after_forward on a GPU: a held prompt whose KV this step completes gets
        its handoff checksum queued behind the forward, read back with the step's tokens."""
        for s in items:
            if s.samples and s.seq.hold_kv:
                self.kv.queue_checksum(s.seq.request_id, s.seq.block_table)

    def _finish_step(self, out: SchedulerOutput, pending: PendingStep) -> list[RequestOutput]:
        result = pending.result()
        for rid, lps in pending.prompt_logprobs.items():
            seq = self.seqs.get(rid)
            if seq is not None and seq.prompt_logprobs is not None:
                for position, lp in lps:  # by position: a preempted prompt's recompute agrees
                    seq.prompt_logprobs[position] = lp
        if self.speculator:
            self.speculator.record(result.num_drafts, result.num_accepted)
        now = time.monotonic()
        appended = []
        for seq, tokens, lps in zip(result.seqs, result.token_ids, result.logprobs, strict=True):
            if seq.is_finished:  # aborted, or (overlap) ended by the step before: a wasted row
                continue
            # Token by token: the first one that ends the request discards those after it.
            new_ids: list[int] = []
            new_text, reason = "", None
            for token in tokens:
                delta, reason = self._append(seq, token)
                new_ids.append(token)
                new_text += delta
                if reason is not None:
                    break
            appended.append((seq, new_ids, new_text, lps, reason))
        if not self.overlap:
            self.scheduler.update(out)  # after the appends: it counts verified tokens
        outputs = []
        for seq, new_ids, new_text, lps, reason in appended:
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.n > 1 and seq.num_output_tokens:  # before its blocks may be freed
                self._fork(seq)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(self._output(seq, new_ids, new_text, lps, now))
        return outputs

    def _add_placeholders(self, pending: PendingStep) -> None:
        """Overlap: each sequence that sampled in the step just launched, and may go on, gets a
        placeholder for that token, so the next schedule() gives it a decode row (penalties
        read the token on the device; a constrained row's sampling waits for its matcher to see
        the token, see PendingStep). Sequences that hand their blocks off when they end, or that
        this token surely ends, wait for the real token."""
        for row, seq in enumerate(pending.seqs):
            p = seq.params
            if (seq.is_finished or seq.hold_kv
                    or seq.num_output_tokens + 1 >= p.max_tokens
                    or seq.num_tokens + 1 >= self.max_model_len):
                continue
            seq.append_token(-1 - row)

    def _append(self, seq: Sequence, token: int) -> tuple[str, FinishReason | None]:
        """Append a sampled token (or resolve its placeholder); returns (text delta, finish
        reason or None)."""
        if seq.token_ids[-1] < 0:
            seq.resolve_placeholder(token)
        else:
            seq.append_token(token)
        p = seq.params
        reason = None
        # The sampler masks EOS and stop ids while fewer than min_tokens are out.
        if token in p.stop_token_ids or (not p.ignore_eos and token in seq.eos_token_ids):
            reason = FinishReason.STOP
        if reason is None and (seq.num_output_tokens >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if seq.grammar is not None:  # a dead end's stop token is what the grammar rejects
            if not seq.grammar.accept(token):
                reason = FinishReason.GRAMMAR
            elif seq.grammar.terminated:
                reason = FinishReason.STOP
        text = self.texts.get(seq.request_id)
        if text is None:
            return "", reason
        delta = text.detok.add([token])
        if reason is not None:  # release a trailing incomplete character at the end
            delta += text.detok.flush()
        text.raw += delta
        emit, stopped = text.stops.check(text.raw, delta,
                                         can_stop=seq.num_output_tokens >= p.min_tokens)
        if stopped:
            reason = FinishReason.STOP
        elif reason is not None:
            emit += text.stops.flush()
        text.text += emit
        return emit, reason

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        if seq.hold_kv and reason is not FinishReason.ABORT:
            self.kv.hold(seq.request_id, seq.block_table)

    def _forget(self, request_id: str) -> None:
        self.texts.pop(request_id, None)
        self.runner.sampler.forget(request_id)
        if self.speculator:
            self.speculator.forget(request_id)

    def _output(self, seq: Sequence, new_ids: list[int], new_text: str,
                logprobs: list | None, now: float) -> RequestOutput:
        finished = seq.is_finished
        text = self.texts.get(seq.request_id)
        out = RequestOutput(
            request_id=seq.parent_id or seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_ids,
            new_text=new_text,
            _outputs=seq.output_token_ids,
            _num_outputs=seq.num_output_tokens,
            finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time,
                                   seq.first_token_time, now if finished else None),
            held_block_ids=(list(self.kv.held[seq.request_id]) if seq.request_id in self.kv.held
                            else None),
            block_hashes=list(seq.block_hashes[:seq.num_prompt_tokens // self.config.cache.block_size]),
            logprobs=logprobs,
            text=text.text if text else "",
            index=seq.choice_index,
        )
        if seq.prompt_logprobs is not None and (seq.num_output_tokens or finished):
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        if finished:
            self.seqs.pop(seq.request_id, None)
            self._forget(seq.request_id)
            group = out.request_id
            out.last = group not in self.seqs and all(
                c not in self.seqs for c in self._choices.get(group, ()))
            if out.last:
                self._choices.pop(group, None)
        return out

    # ---- convenience ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 hold_kv: bool = False) -> list[RequestOutput]:
        """Run prompts to completion (all submitted at once so they batch); final outputs in order
        (hold_kv: see add_request)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p, hold_kv=hold_kv)
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {rid: [] for rid in ids}
        while self.has_unfinished():
            outputs = self.step()
            if not outputs and self._compiling and not self.num_running and not self._in_flight:
                # Only requests whose grammars compile are left: wait for one rather than spin
                # here, which slowed the compile thread (and a cold xgrammar import) twofold.
                wait([seq.grammar.future for seq in self._compiling], return_when=FIRST_COMPLETED)
            for o in outputs:
                if o.logprobs:
                    logprobs[o.request_id].extend(o.logprobs)
                if o.finished:
                    final[o.request_id] = o
        for rid in ids:
            if logprobs[rid]:
                final[rid].logprobs = logprobs[rid]
        return [final[rid] for rid in ids]

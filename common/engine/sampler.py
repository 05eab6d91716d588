"""Next-token sampling for a batch of sequences: penalties, temperature, min-p/top-k/top-p, seeds.

Order of operations for each row (each step is skipped when no row in the batch needs it):

    raw logits --(log_softmax)--> the logprobs a request asked for (vLLM V1's default)
        |
        structured outputs: tokens a row's grammar forbids get -inf (common/engine/structured.py,
            one launch for all constrained rows)
        min_tokens: EOS and stop_token_ids get -inf while the row has fewer outputs than asked
        repetition penalty (HF: prompt + output tokens), then frequency/presence (OpenAI: outputs)
        |-- greedy rows (temperature ~0 or top_k == 1): argmax, no randomness consumed
        `-- other rows: / temperature -> min-p -> top-k -> top-p -> softmax -> exponential race

The exponential race picks argmax(probs / E) with E ~ Exp(1) per token, which samples exactly from
probs. A seeded request draws its E row from its own torch.Generator, one draw per sampled token, so
its tokens do not depend on the rest of the batch, the batch order, or recomputation after
preemption (which does not sample). The whole call makes one host-device sync: the final tolist().
sample() stops short of it: it returns a DeviceSample whose tokens stay on the device (the next
step can read them there) and whose copy to the host is already under way; result() waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.engine.core.sampling_params import SamplingParams
from common.engine.core.sequence import Sequence
from common.engine.structured import TokenMasker
from common.engine.uploads import to_device


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw logits
    top: tuple[tuple[int, float], ...]  # the params.logprobs most likely (token_id, logprob)
    rank: int | None = None  # prompt_logprobs: 1 + how many tokens were more likely


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where the request did not ask for logprobs


class DeviceSample:
    """A batch's sampled tokens (and packed logprobs) on the device, copying to the host.

    tokens: [n] int64 on the device, row i for the i-th sequence passed to Sampler.sample.
    result() waits for the copy (the step's one sync) and unpacks it."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor | None,
                 logprobs_n: list[int | None]):
        self.tokens = tokens
        self._logprobs_n = logprobs_n  # per row: params.logprobs
        src = packed if packed is not None else tokens
        self._host = src
        self._ready: torch.cuda.Event | None = None
        if src.device.type == "cuda":
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._result = _unpack(self._host, self._logprobs_n)
        return self._result


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of [rows, vocab] scores, the same indices; on CUDA through
    kernels.argmax, whose chunks run side by side (one 128k row: 27 -> 4 us on the H200)."""
    if x.is_cuda and x.dim() == 2 and x.shape[1] > 0 and x.stride(-1) == 1:
        from kernels.argmax import argmax_rows  # Triton: imported only where it runs
        return argmax_rows(x)
    return x.argmax(dim=-1)


class Sampler:
    """Stateless except for the per-request generators of seeded requests (see forget())."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self.masker = TokenMasker()
        self._work: torch.Tensor | None = None  # see _working_copy

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator; unknown ids are ignored."""
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: [num_seqs, vocab], float32 or the model's dtype; row i belongs to seqs[i]
        return self.sample(logits, seqs).result()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               previous: torch.Tensor | None = None) -> DeviceSample:
        """As __call__, without waiting for the device. previous: the tokens the step before
        sampled, on the device, which placeholder outputs (-(1 + row), overlap scheduling)
        stand for; penalties read them there."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
        if not seqs:
            return DeviceSample(torch.empty(0, dtype=torch.long, device=logits.device), None, [])
        masked = [i for i, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens]
        penalised = [i for i, seq in enumerate(seqs) if seq.params.needs_penalties]
        # A finished row (overlap: ended by the step read before this deferred sampling) is
        # wasted; its matcher may be terminated.
        constrained = [i for i, seq in enumerate(seqs)
                       if seq.grammar is not None and not seq.is_finished]
        if any(seqs[i].token_ids[-1] < 0 for i in constrained):
            raise RuntimeError("a constrained row sampled before its last token is known")
        if logits.dtype != torch.float32 and (masked or penalised or constrained or not all(
                seq.params.greedy and seq.params.logprobs is None for seq in seqs)):
            # Lower-precision logits (the CUDA decode graphs') are upcast before anything
            # computes with them; a plain greedy batch takes their argmax as it is (upcasting
            # keeps the order, so the tokens are the same).
            logits = logits.float()
        work = self._working_copy(logits) if masked or penalised or constrained else logits
        if constrained:
            self.masker.apply(work, constrained, [seqs[i].grammar for i in constrained])
        if masked:
            _mask_stop_tokens(work, [seqs[i] for i in masked], masked)
        if penalised:
            _apply_penalties(work, [seqs[i] for i in penalised], penalised, previous)
        tokens = self._pick_tokens(work, seqs)
        return _collect(logits, tokens, seqs)

    def _working_copy(self, logits: torch.Tensor) -> torch.Tensor:
        """logits copied into memory kept across calls (grown as needed), which masks and
        penalties then change in place while the raw logits stay for logprobs. A fresh copy
        each step page-faults its memory in: 7 ms for one 49k-vocab row on the 2-core CPU box,
        against 0.2 ms for the whole greedy sample."""
        n = logits.numel()
        buf = self._work
        if buf is None or buf.numel() < n or buf.device != logits.device or (
                buf.dtype != logits.dtype):
            grown = max(n, 2 * buf.numel()) if buf is not None and buf.dtype == logits.dtype else n
            buf = self._work = torch.empty(grown, dtype=logits.dtype, device=logits.device)
        return buf[:n].view(logits.shape).copy_(logits)

    def _pick_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
        if len(greedy) == len(seqs):
            return row_argmax(logits)
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if not greedy:
            return self._sample(logits, seqs)
        device = logits.device
        tokens = torch.empty(len(seqs), dtype=torch.long, device=device)
        greedy_rows = to_device(greedy, torch.long, device)
        sampled_rows = to_device(sampled, torch.long, device)
        tokens[greedy_rows] = row_argmax(logits[greedy_rows])
        tokens[sampled_rows] = self._sample(logits[sampled_rows], [seqs[i] for i in sampled])
        return tokens

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        probs = processed_probs(logits, [seq.params for seq in seqs])
        vocab = logits.shape[1]
        return row_argmax(probs.div_(self._exponential_noise(seqs, vocab, logits.device)))

    def _exponential_noise(self, seqs: list[Sequence], vocab: int,
                           device: torch.device) -> torch.Tensor:
        noise = torch.empty(len(seqs), vocab, dtype=torch.float32, device=device)
        unseeded = [i for i, seq in enumerate(seqs) if seq.params.seed is None]
        if len(unseeded) == len(seqs):
            noise.exponential_()
        else:
            if unseeded:
                shared = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=device)
                noise[to_device(unseeded, torch.long, device)] = shared.exponential_()
            for i, seq in enumerate(seqs):
                if seq.params.seed is not None:
                    noise[i].exponential_(generator=self._generator(seq, vocab, device))
        # Exp(1) can return 0 in principle; a 0 would turn a masked token's 0 / 0 into NaN.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _generator(self, seq: Sequence, vocab: int, device: torch.device) -> torch.Generator:
        generator = self._generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seq.params.seed)
            # A request that arrives with outputs already sampled (by another service before a
            # handoff) resumes its stream: skip the draws those tokens used.
            scratch = torch.empty(vocab, dtype=torch.float32, device=device)
            for _ in range(seq.num_output_tokens):
                scratch.exponential_(generator=generator)
            self._generators[seq.request_id] = generator
        return generator


def _mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """In place: EOS and stop_token_ids get -inf in the given rows (min_tokens not reached)."""
    vocab = logits.shape[1]
    flat = [row * vocab + t for row, seq in zip(rows, seqs, strict=True)
            for t in {*seq.eos_token_ids, *seq.params.stop_token_ids} if t < vocab]
    if flat:
        logits.view(-1).index_fill_(0, to_device(flat, torch.long, logits.device), float("-inf"))


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                     previous: torch.Tensor | None = None) -> None:
    """In place on the given rows: repetition penalty over prompt + output tokens (HF: divide a
    positive logit, multiply a negative one), then frequency * count and presence * (count > 0)
    over output tokens subtracted (OpenAI). An output that is a placeholder is read from
    `previous` on the device."""
    device, vocab = logits.device, logits.shape[1]
    # Flat positions row * vocab + token in the [len(seqs), vocab] penalty tensors.
    out_flat = [j * vocab + t for j, seq in enumerate(seqs) for t in seq.output_token_ids
                if t >= 0]
    prompt_flat = [j * vocab + t for j, seq in enumerate(seqs) for t in seq.prompt_token_ids]
    pending = [(j, -t - 1) for j, seq in enumerate(seqs) for t in seq.output_token_ids if t < 0]
    factors = to_device(
        [[s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
         for s in seqs], torch.float32, device)
    out_index = to_device(out_flat, torch.long, device)
    if pending:
        if previous is None:
            raise ValueError("placeholder outputs need the previous step's tokens")
        where = to_device(pending, torch.long, device)
        out_index = torch.cat([out_index, where[:, 0] * vocab + previous[where[:, 1]]])
    seen_index = torch.cat([to_device(prompt_flat, torch.long, device), out_index])
    row_index = to_device(rows, torch.long, device)

    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=device)
    counts.view(-1).index_add_(0, out_index, torch.ones(out_index.numel(), device=device))
    seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
    seen.view(-1).index_fill_(0, seen_index, True)

    sub = logits[row_index]
    repetition = factors[:, 0:1]
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub -= factors[:, 1:2] * counts + factors[:, 2:3] * (counts > 0).float()
    logits[row_index] = sub


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    # top_k: [rows, 1], vocab where off. Keeps exactly k tokens (ties broken by topk's order).
    _, indices = logits.topk(max_k, dim=-1)
    keep_ranked = torch.arange(max_k, device=logits.device) < top_k
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, keep_ranked)
    keep |= top_k >= logits.shape[1]
    return logits.masked_fill(~keep, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # Top-p keeps the smallest set of most likely tokens (after top-k) whose mass reaches p:
    # a token survives while the mass ranked strictly above it is still below p.
    ranked, indices = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    drop_ranked = rank >= top_k
    ranked = ranked.masked_fill(drop_ranked, float("-inf"))
    probs = ranked.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    drop_ranked |= (mass_above >= top_p) & (top_p < 1.0)
    drop = torch.empty_like(drop_ranked).scatter_(1, indices, drop_ranked)
    return logits.masked_fill(drop, float("-inf"))


def _collect(raw: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> DeviceSample:
    logprobs_n = [seq.params.logprobs for seq in seqs]
    wanted = [i for i, n in enumerate(logprobs_n) if n is not None]
    if not wanted:
        return DeviceSample(tokens, None, logprobs_n)
    # Token ids, sampled logprobs and the top-n pairs travel in one float64 tensor (ids < 2**53
    # are exact) so that the host syncs once.
    n = max(logprobs_n[i] for i in wanted)
    rows = to_device(wanted, torch.long, raw.device)
    logprobs = raw[rows].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[rows].unsqueeze(1))
    top_values, top_ids = logprobs.topk(n, dim=-1)
    packed = torch.zeros(len(seqs), 2 + 2 * n, dtype=torch.float64, device=raw.device)
    packed[:, 0] = tokens
    packed[rows, 1:] = torch.cat([chosen.double(), top_ids.double(), top_values.double()], dim=1)
    return DeviceSample(tokens, packed, logprobs_n)


def _unpack(host: torch.Tensor, logprobs_n: list[int | None]) -> SamplerOutput:
    """host: the tokens [n] int64, or the packed [n, 2 + 2 * top_n] float64 of _collect."""
    if host.dim() == 1:
        return SamplerOutput(host.tolist(), [None] * len(logprobs_n))
    rows = host.tolist()
    n = (host.shape[1] - 2) // 2
    out: list[TokenLogprobs | None] = [None] * len(rows)
    for i, k in enumerate(logprobs_n):
        if k is not None:
            row = rows[i]
            top = tuple((int(t), v) for t, v in zip(row[2:2 + k], row[2 + n:2 + n + k],
                                                     strict=True))
            out[i] = TokenLogprobs(int(row[0]), row[1], top)
    return SamplerOutput([int(row[0]) for row in rows], out)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a row is sampled from: logits [n, vocab] float32 (after min_tokens
    masking and penalties), row i with params[i] (temperature > 0) -> [n, vocab] probabilities.
    Temperature, then min-p, then top-k / top-p. Speculative verification judges drafts against
    exactly this p."""
    vocab = logits.shape[1]
    settings = to_device(
        [[p.temperature, p.min_p, float(p.top_k if p.top_k > 0 else vocab), p.top_p]
         for p in params], torch.float32, logits.device)
    logits = logits / settings[:, 0:1]
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        floor = settings[:, 1:2] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    top_k = settings[:, 2:3].long()
    if any(p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, top_k, settings[:, 3:4])
    elif any(p.top_k > 0 for p in params):
        logits = _top_k(logits, top_k, max(min(p.top_k, vocab) for p in params))
    return logits.softmax(dim=-1)

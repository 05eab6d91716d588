"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens, one
forward step at a time, batched across the sequences that speculate.

Its KV lives in its own paged pool with its own block tables (a BlockManager without prefix
caching; the pool has as many blocks as the target's, which reserves memory for it), and it
catches up on a sequence's tokens the same way the target does:

    seq.token_ids:  | prompt ................ | outputs ..... |
    draft KV:       |<- draft computed ->|<- fed this step ->| d1 d2 .. d_(k-1)
                                                           -> d1  d2 d3 .. d_k

Its computed count never exceeds the target's (min with seq.num_computed_tokens), which is
how rejected drafts are rolled back: the target only counts verified tokens.

Disaggregated serving: the draft's prompt KV is computed here, on the decode side, the first
time a sequence speculates (from zero, like any prefill); it never travels in the handoff. The
handoff then stays one model's KV, the prefill service needs no knowledge of the draft, and the
draft is small enough that its prefill costs a fraction of the target's. A catch-up longer than
max_num_batched_tokens is chunked over steps; the sequence does not speculate meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.config import EngineConfig
from common.engine.core.block_manager import BlockManager
from common.engine.core.sequence import Sequence
from common.engine.model_runner import step_tensors
from common.engine.sampler import processed_probs, row_argmax
from common.engine.step_input import StepRow, build_step_input
from common.engine.uploads import to_device
from common.models.attention import AttentionBackend
from common.models.llama import LlamaModel
from common.models.loader import load_model
from common.models.model_config import ModelConfig
from common.models.ops_onednn import install_cpu_ops
from common.spec_decode.proposer import Draft, Proposer


def load_draft_model(config: EngineConfig, target: ModelConfig, dtype: torch.dtype,
                     device: torch.device) -> tuple[LlamaModel, ModelConfig]:
    assert config.speculative.model is not None
    model, mc = load_model(config.speculative.model, dtype=dtype, device=device,
                           cache_dir=config.model.model_cache_dir)
    if device.type == "cpu":
        install_cpu_ops(model, config.model.cpu_linear)
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {config.speculative.model!r} has vocabulary size "
                         f"{mc.vocab_size}, the target {target.vocab_size}: they must match")
    return model, mc


def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return (2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim
            * torch.empty((), dtype=dtype).element_size())


@dataclass(slots=True)
class _Row:
    owner: int  # index of the sequence in propose()'s list
    # num_logits 1: it drafts; 0: a chunk of a long catch-up, no draft token this step
    step_row: StepRow


@dataclass(slots=True)
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of the sequence whose draft KV is valid


class DraftModelProposer(Proposer):
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 backend: AttentionBackend, max_num_batched_tokens: int):
        mc = model.config
        weight = model.embed_tokens.weight
        self.model = model
        self.device = weight.device
        self.block_size = block_size
        self.backend = backend
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache = torch.zeros(  # zeroed: see common.engine.model_runner.default_kv_allocator
            (mc.num_layers, 2, num_blocks, block_size, mc.num_kv_heads, mc.head_dim),
            dtype=weight.dtype, device=self.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.states: dict[str, _DraftState] = {}
        # Seeded requests draw their drafts from a stream of their own (not the target's).
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.block_manager.free(state.block_table)
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        # Step 0 feeds each sequence the tokens the draft has not seen (usually 1 or 2, the
        # whole prompt the first time) and yields d1; step j feeds d_j and yields d_(j+1).
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        rows = self._catch_up(seqs, max_tokens)
        while rows:
            rows.sort(key=lambda row: len(row.step_row.token_ids) != 1)  # decodes first
            drafting = [row.owner for row in rows if row.step_row.num_logits]
            chosen, q = self._sample(self._forward(seqs, rows), [seqs[i] for i in drafting])
            rows = []
            for i, token, q_row in zip(drafting, chosen, q, strict=True):
                tokens[i].append(token)
                if q_row is not None:
                    probs[i].append(q_row)
                if len(tokens[i]) < max_tokens[i]:
                    state = self.states[seqs[i].request_id]
                    rows.append(_Row(i, StepRow([token], state.num_computed, state.block_table,
                                                num_logits=1)))
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)]

    def _catch_up(self, seqs: list[Sequence], max_tokens: list[int]) -> list[_Row]:
        """Step 0's rows: what each sequence's draft KV lacks, within the token budget."""
        budget = self.max_num_batched_tokens
        rows: list[_Row] = []
        for i, (seq, k) in enumerate(zip(seqs, max_tokens, strict=True)):
            state = self.states.get(seq.request_id)
            if state is None:
                state = self.states[seq.request_id] = _DraftState()
            state.num_computed = min(state.num_computed, seq.num_computed_tokens)
            start = state.num_computed
            need = seq.num_tokens - start
            take = min(need, budget)
            # Blocks for what is fed now and, once caught up, for the k - 1 drafts fed back.
            total = start + take + (k - 1 if take == need else 0)
            if take <= 0 or not self.block_manager.allocate(state.block_table, total):
                continue
            budget -= take
            rows.append(_Row(i, StepRow(seq.token_ids[start:start + take], start,
                                        state.block_table, num_logits=int(take == need))))
        return rows

    def _forward(self, seqs: list[Sequence], rows: list[_Row]) -> torch.Tensor:
        """Run the draft on rows (decodes first); logits at the last token of drafting rows."""
        step = build_step_input([row.step_row for row in rows], self.block_size)
        input_ids, positions, meta = step_tensors(step, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend)
        for row in rows:
            tokens, start = row.step_row.token_ids, row.step_row.start
            self.states[seqs[row.owner].request_id].num_computed = start + len(tokens)
        last = to_device(step.logit_rows, torch.long, self.device)
        return self.model.compute_logits(hidden[last])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy requests take the argmax (q one-hot: None); the others sample from q, the
        draft's logits processed with the request's own settings."""
        token = row_argmax(logits)
        q_rows: list[torch.Tensor | None] = [None] * len(seqs)
        sampled = [k for k, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled:
            rows = to_device(sampled, torch.long, logits.device)
            q = processed_probs(logits[rows], [seqs[k].params for k in sampled])
            noise = torch.empty_like(q).exponential_()
            for n, k in enumerate(sampled):
                if seqs[k].params.seed is not None:
                    noise[n].exponential_(generator=self._generator(seqs[k]))
            token[rows] = row_argmax(q.div(noise.clamp_min_(torch.finfo(torch.float32).tiny)))
            for n, k in enumerate(sampled):
                q_rows[k] = q[n]
        return token.tolist(), q_rows

    def _generator(self, seq: Sequence) -> torch.Generator:
        """A seeded request's drafts come from a stream of their own (not the target's)."""
        assert seq.params.seed is not None
        generator = self.generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self.generators[seq.request_id] = generator
        return generator

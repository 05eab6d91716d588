"""Verification of draft tokens against the target model, losslessly.

For one speculating sequence with drafts x_1..x_k, the target's logits at its last known token
and at every draft give p_1..p_{k+1}, each processed exactly as the plain sampler would at that
position (min_tokens masking by the output count the position would have, temperature, min-p,
top-k, top-p). Walking j = 1..k:

- greedy request: accept x_j while it is the argmax of p_j;
- deterministic proposal (n-gram lookup, greedy draft; q_j one-hot on x_j): draw the target's own
  token t_j ~ p_j and accept x_j while t_j == x_j. This is the textbook rule for one-hot q:
  accept with probability p_j(x_j) = min(1, p/q), else emit a token from p_j with x_j removed,
  which is normalize(max(0, p_j - q_j));
- sampled proposal (a draft model's q_j): accept with probability min(1, p_j(x_j) / q_j(x_j)),
  else emit a token drawn from normalize(max(0, p_j - q_j));

and the first rejection ends the walk with the token drawn there. When all k are accepted a bonus
token is drawn from p_{k+1}. Either way 1 to k + 1 tokens come out per sequence.

Randomness: each position uses one row of Exp(1) noise E, as the plain sampler does per token:
a token drawn from a distribution r is argmax(r / E), and the acceptance uniform is
u = exp(-E[x_j]), which a rejection leaves independent of the resample (there r(x_j) = 0).
A seeded request takes its rows from its own generator (the plain sampler's), and the rows of
positions after the walk ended are given back (the generator is rewound), so the stream advances
one row per emitted token exactly as without speculation. With deterministic proposals this makes
a seeded request's output identical with and without speculation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from common.engine.core.sequence import Sequence
from common.engine.sampler import Sampler, _mask_stop_tokens, processed_probs, row_argmax
from common.engine.uploads import to_device


class VerifyOutput(NamedTuple):
    token_ids: list[list[int]]  # per sequence: its accepted drafts, then one more token
    num_accepted: list[int]


class RejectionSampler:
    """Shares the plain sampler's per-request generators (a request's seeded stream continues
    across steps that speculate and steps that do not)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                 draft_probs: list[torch.Tensor | None]) -> VerifyOutput:
        # logits: [sum(len(d) + 1 for d in drafts), vocab] float32. Sequence i owns
        # len(drafts[i]) + 1 consecutive rows: those of its last known token and of each draft.
        # draft_probs[i]: [len(drafts[i]), vocab], or None for a deterministic proposal.
        counts = [len(d) + 1 for d in drafts]
        if logits.dim() != 2 or logits.shape[0] != sum(counts):
            raise ValueError(f"logits {tuple(logits.shape)} do not match drafts {counts}")
        if any(q is not None and q.shape[0] != len(d)
               for q, d in zip(draft_probs, drafts, strict=True)):
            raise ValueError("draft_probs must hold one row per draft token")
        device, vocab = logits.device, logits.shape[1]
        owner = [i for i, c in enumerate(counts) for _ in range(c)]
        position = [j for c in counts for j in range(c)]
        masked = [r for r, (i, j) in enumerate(zip(owner, position, strict=True))
                  if seqs[i].num_output_tokens + j < seqs[i].params.min_tokens]
        if masked:
            logits = logits.clone()
            _mask_stop_tokens(logits, [seqs[owner[r]] for r in masked], masked)
        # The draft each row judges; -1 on a sequence's last row (the bonus position).
        judged_host = [d[j] if j < len(d) else -1 for d in drafts for j in range(len(d) + 1)]
        judged = to_device(judged_host, torch.long, device)
        token = row_argmax(logits)  # greedy rows keep this
        accept = token == judged
        sampled = [r for r, i in enumerate(owner) if not seqs[i].params.greedy]
        states: dict[int, list[torch.Tensor]] = {}
        if sampled:
            rows = to_device(sampled, torch.long, device)
            probs = processed_probs(logits[rows], [seqs[owner[r]].params for r in sampled])
            noise = self._noise([owner[r] for r in sampled], seqs, vocab, device, states)
            # Rows judging a draft sampled from a known q: the textbook rule. The others
            # (deterministic proposals, bonus rows) draw the target's own token from p.
            dense = [k for k, r in enumerate(sampled)
                     if draft_probs[owner[r]] is not None and judged_host[r] >= 0]
            target = probs
            if dense:
                local = to_device(dense, torch.long, device)
                # Dense rows are every draft row of their sequences, in order.
                q = torch.cat([q_i for i, q_i in enumerate(draft_probs)
                               if q_i is not None and not seqs[i].params.greedy])
                x = to_device([[judged_host[sampled[k]]] for k in dense], torch.long, device)
                p = probs[local]
                u = torch.exp(-noise[local].gather(1, x))
                dense_accept = (u * q.gather(1, x) <= p.gather(1, x)).squeeze(1)
                residual = (p - q).clamp_min_(0.0)
                # p == q to the last bit leaves no residual; a rejection then has probability 0.
                target = probs.clone()
                target[local] = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
            drawn = row_argmax(target.div(noise))
            token[rows] = drawn
            accept[rows] = drawn == judged[rows]
            if dense:
                accept[rows[local]] = dense_accept
        host = torch.stack((accept.long(), token)).tolist()  # the one host sync
        out_tokens: list[list[int]] = []
        num_accepted: list[int] = []
        row = 0
        for i, d in enumerate(drafts):
            a = 0
            while a < len(d) and host[0][row + a]:
                a += 1
            out_tokens.append(d[:a] + [host[1][row + a]])
            num_accepted.append(a)
            if i in states:  # rewind: keep the generator's state after a + 1 rows
                self.sampler._generator(seqs[i], vocab, device).set_state(states[i][a])
            row += counts[i]
        return VerifyOutput(out_tokens, num_accepted)

    def _noise(self, owners: list[int], seqs: list[Sequence], vocab: int, device: torch.device,
               states: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """One Exp(1) row per sampled row. A seeded sequence's rows come from its generator in
        order; states[i] records the generator state after each of them (for the rewind)."""
        noise = torch.empty(len(owners), vocab, dtype=torch.float32, device=device)
        unseeded = [r for r, i in enumerate(owners) if seqs[i].params.seed is None]
        if len(unseeded) == len(owners):
            noise.exponential_()
        elif unseeded:
            shared = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=device)
            noise[to_device(unseeded, torch.long, device)] = shared.exponential_()
        for r, i in enumerate(owners):
            if seqs[i].params.seed is not None:
                generator = self.sampler._generator(seqs[i], vocab, device)
                noise[r].exponential_(generator=generator)
                states.setdefault(i, []).append(generator.get_state())
        # Exp(1) can return 0 in principle; a 0 would turn a masked token's 0 / 0 into NaN.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

"""Our decoder implementation for the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral) and
Qwen2/2.5, running on a paged KV cache.

One step takes a flat batch of T tokens (see AttentionMetadata). Per layer:

    q|k|v, res = rms_norm(h + res) @ Wqkv (+ bias on Qwen2)      ops.norm_qkv_rotary_store
    q          = rotary(q); store rotary(k), v in the paged cache  (the same op)
    o          = paged attention(q, cache)
    h          = o @ Wo
    g|u, res   = rms_norm(h + res) @ Wgate|up                   ops.norm_linear
    h          = silu(g) * u @ Wdown                            ops.act_linear

The element-wise ops and the projections' matmuls go through `model.ops` (a ModelOps) so a CUDA
path can swap in kernels (common.models.ops_triton), which fuse each norm and the activation into
the matmul after it at batch 1 (the qkv one with rotary and the K/V store as well).

Under tensor parallelism (common.models.sharding) a model holds one rank's slice of every weight
(`layout`) and sums through `model.comm`: after o_proj, after down_proj and after the embedding
(one all-reduce each); compute_logits gathers the vocabulary's slices on rank 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.model_config import ModelConfig
from common.models.ops import REFERENCE_OPS, ModelOps
from common.models.rotary import cos_sin_cache
from common.models.sharding import (
    NO_SHARD,
    SINGLE,
    Collectives,
    Shard,
    ShardLayout,
    shard_layout,
)


class WeightTarget(NamedTuple):
    """Where one HF checkpoint tensor of shape `full` goes: parameter rows [start, end) take
    its slice [src_start, src_start + the slice's size) along src_dim (this rank's shard; all
    of it at TP 1)."""
    param: nn.Parameter
    start: int
    end: int
    full: tuple[int, ...]
    src_dim: int = 0
    src_start: int = 0


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype,
            device: torch.device) -> nn.Linear:
    # Uninitialised: the loader (or the dummy initialiser) fills every parameter.
    return skip_init(nn.Linear, n_in, n_out, bias=bias, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, lay: ShardLayout, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = lay.num_heads, lay.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = lay.q_size, lay.kv_size
        self.scale = c.head_dim ** -0.5
        self.qkv_proj = _linear(c.hidden_size, lay.q_size + 2 * lay.kv_size, c.attention_bias,
                                dtype, device)
        self.o_proj = _linear(lay.q_size, c.hidden_size, False, dtype, device)

    @property
    def heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                ops: ModelOps, comm: Collectives) -> torch.Tensor:
        """q: [T, heads, head_dim], rotated, its token's K/V already in the cache (the layer
        computes it with the norm: ops.norm_qkv_rotary_store)."""
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return comm.all_reduce(ops.linear(o.reshape(q.shape[0], self.q_size),
                                          self.o_proj.weight, self.o_proj.bias))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, lay: ShardLayout, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.gate_up_proj = _linear(c.hidden_size, 2 * lay.intermediate, False, dtype, device)
        self.down_proj = _linear(lay.intermediate, c.hidden_size, False, dtype, device)

    def forward(self, gate_up: torch.Tensor, ops: ModelOps, comm: Collectives) -> torch.Tensor:
        """gate_up: the gate|up projection of the normed hidden states (the layer computes it,
        fused with the norm)."""
        return comm.all_reduce(ops.act_linear(gate_up, self.down_proj.weight,
                                              self.down_proj.bias))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, lay: ShardLayout, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Attention(c, lay, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = MLP(c, lay, dtype, device)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, ops: ModelOps,
                comm: Collectives) -> tuple[torch.Tensor, torch.Tensor]:
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        attn, mlp = self.self_attn, self.mlp
        q, residual = ops.norm_qkv_rotary_store(
            h, residual, norm1.weight, norm1.eps, attn.qkv_proj.weight, attn.qkv_proj.bias,
            positions, cos_sin, layer_cache[0], layer_cache[1], meta, backend, attn.heads)
        h = attn(q, layer_cache[0], layer_cache[1], meta, backend, ops, comm)
        gate_up, residual = ops.norm_linear(h, residual, norm2.weight, norm2.eps,
                                            mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        return mlp(gate_up, ops, comm), residual


class LlamaModel(nn.Module):
    """Parameters are created uninitialised on `device` in `dtype`; load_model fills them.
    shard: the tensor-parallel rank whose slices this model holds (see module docstring);
    `comm` must then be set to the ranks' group before the first forward."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 ops: ModelOps = REFERENCE_OPS, shard: Shard = NO_SHARD):
        super().__init__()
        c = config
        self.config = c
        self.ops = ops
        self.layout = lay = shard_layout(c, shard)
        self.comm: Collectives = SINGLE
        self.embed_tokens = skip_init(nn.Embedding, lay.vocab, c.hidden_size, dtype=dtype,
                                      device=device)
        self.layers = nn.ModuleList(DecoderLayer(c, lay, dtype, device)
                                    for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = (None if c.tie_word_embeddings
                        else _linear(c.hidden_size, lay.vocab, False, dtype, device))
        self.register_buffer("cos_sin", cos_sin_cache(c, torch.device(device)), persistent=False)
        self.requires_grad_(False)

    def forward(self,
                input_ids: torch.Tensor,  # [T] int64
                positions: torch.Tensor,  # [T] int64
                kv_cache: torch.Tensor,   # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
                meta: AttentionMetadata,
                backend: AttentionBackend,
                ) -> torch.Tensor:        # [T, hidden]
        h = self._embed(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, self.cos_sin, kv_cache[i], meta, backend,
                                self.ops, self.comm)
        h, _ = self.ops.rms_norm(h, self.norm.weight, self.norm.eps, residual)
        return h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(input_ids, self.embed_tokens.weight)
        # Vocab-parallel: ids outside this rank's rows embed as zeros; the sum has one row each.
        local = input_ids - self.layout.vocab_start
        outside = (local < 0) | (local >= self.layout.vocab)
        h = F.embedding(local.masked_fill(outside, 0), self.embed_tokens.weight)
        return self.comm.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))

    @property
    def logits_weight(self) -> torch.Tensor:
        """[vocab, hidden]: lm_head's weight, or the embedding table when the two are tied
        (this rank's rows under TP)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).weight

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor | None:
        """[n, hidden] -> [n, vocab] float32 (upcast=False: in the model's dtype, which
        Sampler.sample takes too). Under TP every rank calls it and rank 0 gets the logits
        (gathered from the ranks' vocabulary slices); the others get None."""
        logits = self.comm.gather_last_dim(self.ops.linear(hidden, self.logits_weight, None))
        return logits.float() if upcast and logits is not None else logits

    def hf_weight_targets(self) -> dict[str, WeightTarget]:
        """Every HF checkpoint tensor name this model needs -> where (this rank's slice of) it
        goes.

        HF keeps q/k/v and gate/up as separate tensors; we fuse each group into one matmul.
        Column-parallel tensors are sliced by rows (dim 0), row-parallel ones (o, down) by
        input columns (dim 1).
        """
        c, lay = self.config, self.layout
        d, h, v = c.head_dim, c.hidden_size, c.vocab_size
        q, kv, inter = lay.q_size, lay.kv_size, lay.intermediate
        q0, kv0, i0 = lay.head_start * d, lay.kv_head_start * d, lay.inter_start
        T = WeightTarget
        targets: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": T(self.embed_tokens.weight, 0, lay.vocab, (v, h), 0,
                                           lay.vocab_start),
            "model.norm.weight": T(self.norm.weight, 0, h, (h,)),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = T(self.lm_head.weight, 0, lay.vocab, (v, h), 0,
                                          lay.vocab_start)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for norm in ("input_layernorm", "post_attention_layernorm"):
                targets[p + norm + ".weight"] = T(getattr(layer, norm).weight, 0, h, (h,))
            for kind in ("weight", "bias") if c.attention_bias else ("weight",):
                fused = getattr(attn.qkv_proj, kind)
                cols = (h,) if kind == "weight" else ()
                targets[p + f"self_attn.q_proj.{kind}"] = T(fused, 0, q, (c.q_size, *cols), 0, q0)
                for j, name in enumerate(("k_proj", "v_proj")):
                    start = q + j * kv
                    targets[p + f"self_attn.{name}.{kind}"] = T(fused, start, start + kv,
                                                                (c.kv_size, *cols), 0, kv0)
            targets[p + "self_attn.o_proj.weight"] = T(attn.o_proj.weight, 0, h, (h, c.q_size),
                                                       1, q0)
            full_inter = c.intermediate_size
            targets[p + "mlp.gate_proj.weight"] = T(mlp.gate_up_proj.weight, 0, inter,
                                                    (full_inter, h), 0, i0)
            targets[p + "mlp.up_proj.weight"] = T(mlp.gate_up_proj.weight, inter, 2 * inter,
                                                  (full_inter, h), 0, i0)
            targets[p + "mlp.down_proj.weight"] = T(mlp.down_proj.weight, 0, h, (h, full_inter),
                                                    1, i0)
        return targets

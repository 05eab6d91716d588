"""ModelOps for the CPU whose projections run oneDNN's linear on weights reordered ("packed")
once: the CPU path's default where oneDNN is available (EngineConfig.cpu_linear).

On a many-core x86 CPU torch's default fp32 matmul (MKL through F.linear) is slow and uneven
at 2-16 rows, the batch sizes of decoding and speculative verification; oneDNN with a weight
packed for 64 rows ran SmolLM2-135M's projections at 7 rows as fast as at 1. Results differ
from F.linear by float rounding only (~1e-6 relative). bfloat16 weights are packed too where
oneDNN has bf16 kernels for the CPU (AVX-512 BF16 or AMX): at 32 rows SmolLM2's projections took
0.60 ms a layer against F.linear's 0.72, its logits 5.4 ms against 7.6 (2-core AVX-512 box).
On an x86 CPU without them (AVX-512 alone: torch reports bf16 support there, and oneDNN
emulates it) bf16 weights are packed in float32 instead (widened exactly, so the products and
float32 sums are a bf16 kernel's; the rows widened going in, the result rounded to bf16 coming
out): on the 2-core Ice Lake box (no avx512_bf16) oneDNN's bf16 ran SmolLM2's projections at
24-53 GFLOP/s from 1 to 2048 rows, its float32 at 27-250 on the same shapes (2 to 5x).

install_cpu_ops packs a model's projections; a float32 projection's packed copy is then its only
one (PackedOnly; a bf16 weight packed in float32 too, so that its projection is held once, at
twice the bytes): the module's weight becomes a stand-in on the meta device, whose values
dense_weight() gives, and decode rows read the packed copy through
kernels.cpu_layer_ops.packed_linear. (Freeing the original's storage in place was tried in the
seventh session and undone: such a tensor keeps its shape, and anything that touched it read
freed memory and crashed the process; a meta tensor has no memory to read, and mixing it with
CPU tensors raises.) The logits weight is packed in float32 whatever the model's dtype, so that
a bf16 model's logits are float32 too (its bf16 hidden states widen exactly), and stays beside
its packed copy.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import sys

import torch
import torch.nn.functional as F
from torch import nn

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.fp8 import is_quantized
from common.models.ops import (
    REFERENCE_OPS,
    Heads,
    ModelOps,
    compose_act_linear,
    compose_norm_linear,
    compose_norm_qkv_rotary_store,
)
from kernels import cpu_layer_ops

# The row count oneDNN lays a packed weight out for; 64 beat 1 at every row count measured
# (1-64 rows, SmolLM2-135M on AVX-512).
BATCH_SIZE_HINT = 64


@functools.cache
def onednn_bf16_available() -> bool:
    """oneDNN has native bf16 kernels for this CPU (on x86: AVX-512 BF16 or AMX; elsewhere
    torch's word). torch's _is_mkldnn_bf16_supported() is true on any AVX-512 CPU, where oneDNN
    emulates bf16 at a fraction of its float32 rate (module docstring)."""
    if not (onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.cache
def onednn_available() -> bool:
    """oneDNN is built in, exposes the two ops, and runs them on this CPU."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), BATCH_SIZE_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


# Rows up to which kernels.cpu_layer_ops.small_linear runs a projection in place of oneDNN's
# GEMM (the build's own limit applies too: 8 with AVX-512). SmolLM2's 30 layers on the AVX2 box, 1
# thread, float32 ms small_linear / oneDNN: 8.3 / 13.1 at 1 row, 14.3 / 21.6 at 4, 33.4 / 32.0 at
# 8, 57.7 / 59.7 at 16, 119.9 / 99.5 at 32. The float32 logits (49152 x 576) tie at 1 row and
# lose above (11.9 / 10.1 ms at 4), so they take it at 1 row only. (On the AVX-512 box the
# eighth session measured up to 8 rows, the build's limit there.)
SMALL_LINEAR_ROWS = 16
SMALL_LINEAR_LOGITS_ROWS = 1


class OneDnnLinear:
    """F.linear's signature; each weight is packed at its first use (or by pack()) and the
    packed copy reused while the weight object lives and is not modified in place (its
    version counter is checked). Calls it cannot serve go to F.linear: mixed dtypes, tensors
    off the CPU, calls autograd would record, and dtypes neither oneDNN nor small_linear takes.
    A weight marked by wide_output (a bf16 model's logits) gives float32.

    Which runs a call:
    - kernels.cpu_layer_ops.small_linear on the original weight, without a bias, at up to
      SMALL_LINEAR_ROWS rows (SMALL_LINEAR_LOGITS_ROWS for a float32 logits weight): a decode
      step's rows read each weight once at memory speed, where oneDNN's GEMM on weights packed
      for 64 rows streams them at 8-25 GB/s; and a bf16 weight at every row count where oneDNN
      has no bf16 kernels (AVX2: F.linear ran bf16 6x slower than small_linear, at 1-512 rows);
    - else oneDNN on the packed copy (in float32 for a wide-output weight, and for a bf16 one
      where oneDNN has no native bf16 kernels: pack_dtype);
    - else F.linear."""

    def __init__(self, batch_size_hint: int = BATCH_SIZE_HINT):
        self.batch_size_hint = batch_size_hint
        # id(weight) -> (weight, its version when packed, packed copy); the weight is held so
        # that its id is not reused while the entry exists.
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._wide: dict[int, torch.Tensor] = {}  # id -> a weight whose output is float32
        self.num_packs = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.serves(x, weight, bias):
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        held = packed_only(weight)
        wide = self._wide.get(id(weight)) is weight and x.dtype != torch.float32
        if held is not None:
            out = held(x2, bias)
        elif bias is None and cpu_layer_ops.small_linear_serves(x2, weight,
                                                                self.small_rows(weight)):
            out = cpu_layer_ops.small_linear(x2, weight, float32_out=wide)
        elif packable(weight):
            packed = self.pack(weight, torch.float32 if wide else None)
            out = _onednn_linear(x2, packed, bias, torch.float32 if wide else x.dtype)
        else:
            out = F.linear(x2, weight, bias)
            out = out.float() if wide else out
        return out.view(*x.shape[:-1], weight.shape[0])

    def serves(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        tensors = (x,) if bias is None else (x, bias)
        if not (weight.dim() == 2 and x.dim() >= 1
                and all(t.dtype == weight.dtype and t.device.type == "cpu" for t in tensors)
                and not (torch.is_grad_enabled()
                         and any(t.requires_grad for t in (*tensors, weight)))):
            return False
        return packed_only(weight) is not None or (
            weight.device.type == "cpu"
            and (packable(weight) or cpu_layer_ops.small_linear_dtype(weight.dtype)))

    def hold_packed_only(self, module: nn.Linear) -> bool:
        """Packs module's weight and, where it is packed in float32 (pack_dtype) and
        packed_linear reads oneDNN's layout of it,
        replaces the weight by a stand-in that holds the packed copy only (PackedOnly); the
        original is freed once nothing else holds it. Whether it did."""
        weight = module.weight
        packed = self.pack(weight)
        view = packed_layout_view(packed, weight)
        if view is None:
            return False
        stand_in = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                requires_grad=False)
        setattr(stand_in, PACKED_ONLY, PackedOnly(packed, view, weight.shape[0]))
        module.weight = stand_in
        del self._packed[id(weight)]
        return True

    def small_rows(self, weight: torch.Tensor) -> int:
        """The most rows small_linear takes weight at (before the build's own limit)."""
        if weight.dtype == torch.bfloat16 and not onednn_bf16_available():
            return sys.maxsize
        if weight.dtype == torch.float32 and self._wide.get(id(weight)) is weight:
            return SMALL_LINEAR_LOGITS_ROWS
        return SMALL_LINEAR_ROWS

    def wide_output(self, weight: torch.Tensor) -> None:
        """Marks weight as one whose output is float32 whatever its dtype (the logits)."""
        self._wide[id(weight)] = weight

    def pack(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The packed copy of weight [N, K] (made now, in dtype, default pack_dtype's, if there
        is none or it is stale)."""
        version = _version(weight)
        entry = self._packed.get(id(weight))
        if entry is not None and entry[0] is weight and entry[1] == version:
            return entry[2]
        packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().to(dtype or pack_dtype(weight) or weight.dtype).contiguous(),
            self.batch_size_hint)
        self._packed[id(weight)] = (weight, version, packed)
        self.num_packs += 1
        return packed


# Rows up to which a weight held packed only (PackedOnly) runs through
# kernels.cpu_layer_ops.packed_linear (an AVX2 kernel), above which through oneDNN's GEMM on the
# same copy: 8 where torch's CPU capability is AVX2 (the twelfth session's Zen 3 box, 2 threads,
# SmolLM2's 30 layers, median of 15: 22.9 / 31.0 / 40.9 / 52.5 ms at 1 / 4 / 8 / 12 rows against
# oneDNN's 30.9 / 34.0 / 42.7 / 44.2; the ninth session's 16 came from 1-thread figures: at 2
# threads oneDNN ran 9-16 rows 25-35% faster than the kernel did), 1 on an AVX-512 CPU, whose
# oneDNN kernels win from 2 rows (AVX-512 box, 2 threads, same weights, median of 5: 13.6 ms
# both at 1 row; 17.8 / 21.7 / 33.2 / 49.0 against 14.3 / 13.9 / 19.4 / 18.5 at 2 / 4 / 8 / 16;
# the kernel then took half a block a task, see the .cpp).
PACKED_LINEAR_ROWS = {"AVX2": 8}
PACKED_LINEAR_ROWS_OTHERWISE = 1


@functools.cache
def packed_linear_rows() -> int:
    """PACKED_LINEAR_ROWS for this CPU's capability (torch.backends.cpu)."""
    return PACKED_LINEAR_ROWS.get(torch.backends.cpu.get_cpu_capability(),
                                  PACKED_LINEAR_ROWS_OTHERWISE)

# The attribute of a stand-in weight (on the meta device) that holds its packed copy.
PACKED_ONLY = "splitserve_packed_only"


@dataclasses.dataclass(frozen=True)
class PackedOnly:
    """A projection weight [N, K] held only as oneDNN's packed copy in float32 (a float32
    weight's, or a bf16 one's where oneDNN has no native bf16: rows widened going in, the
    result rounded to bf16): decode rows read it through kernels.cpu_layer_ops.packed_linear,
    more rows through oneDNN. The module's weight is then a stand-in on the meta device (its
    shape and dtype, no values: reading it raises rather than reading freed memory) carrying
    this; dense_weight() gives the values."""
    packed: torch.Tensor  # oneDNN's opaque tensor
    view: torch.Tensor    # its storage: [ceil(N / 64), KP, 64] float32 (packed_linear's weight)
    n: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [M, K]
        if bias is None and x.shape[0] <= packed_linear_rows():
            xf = x.float() if x.dtype != torch.float32 else x
            out = cpu_layer_ops.packed_linear(xf if xf.stride(1) == 1 else xf.contiguous(),
                                              self.view, self.n)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        return _onednn_linear(x, self.packed, bias, x.dtype)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """oneDNN's GEMM x [M, K] @ packed, in packed's dtype (x and bias widened to it where they
    are bf16: exact), the result in out_dtype."""
    if x.dtype != packed.dtype:
        x, bias = x.to(packed.dtype), None if bias is None else bias.to(packed.dtype)
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if out.dtype == out_dtype else out.to(out_dtype)


def packed_only(weight: torch.Tensor) -> PackedOnly | None:
    return getattr(weight, PACKED_ONLY, None)


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight's values as a CPU tensor: the weight itself, or for a stand-in (PackedOnly) its
    packed copy unpacked (a new tensor: writing to it changes nothing the model reads). Every
    reader of a projection weight after install_cpu_ops goes through this."""
    held = packed_only(weight)
    return weight if held is None else held.packed.to_dense().to(weight.dtype)


def packed_layout_view(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """packed's storage as [ceil(N / 64), KP, 64] (KP: K rounded up to 16), the layout oneDNN
    gave float32 weights packed for 64 rows on AVX2 and AVX-512, checked element by element
    against weight [N, K] (float32, or bf16 widened); None where packed is not float32, the
    layout is another or packed_linear is not built."""
    if not (packed.dtype == torch.float32 and cpu_layer_ops.packed_linear_available()):
        return None
    n, k = weight.shape
    nb, kp = -(-n // 64), -(-k // 16) * 16
    numel = torch.ops.mkldnn._nbytes(packed) // 4
    if numel != nb * kp * 64:
        return None
    view = cpu_layer_ops.alias_storage(packed, torch.ops.mkldnn.data_ptr(packed), numel)
    view = view.view(nb, kp, 64)
    same = torch.equal(view.transpose(1, 2).reshape(nb * 64, kp)[:n, :k], weight.float())
    return view if same else None


def restore_dense_weights(model: nn.Module) -> None:
    """Gives every nn.Linear whose weight is a stand-in (PackedOnly) its dense weight back."""
    for m in model.modules():
        if isinstance(m, nn.Linear) and packed_only(m.weight) is not None:
            m.weight = nn.Parameter(dense_weight(m.weight), requires_grad=False)


def pack_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype oneDNN runs weight's projection in, or None where it is not packed: a float32
    weight in float32; a bf16 one in bf16 where oneDNN has native bf16 kernels, else in float32
    unless small_linear takes bf16 at every row count (the AVX2 build, which widens bf16 in
    registers and ran it 6x faster than F.linear)."""
    if not (onednn_available() and weight.dim() == 2 and weight.device.type == "cpu"):
        return None
    if weight.dtype == torch.float32:
        return torch.float32
    if weight.dtype == torch.bfloat16:
        if onednn_bf16_available():
            return torch.bfloat16
        return None if cpu_layer_ops.bf16_dot_available() else torch.float32
    return None


def packable(weight: torch.Tensor) -> bool:
    return pack_dtype(weight) is not None


def _version(t: torch.Tensor) -> int:
    # Inference tensors keep no version counter (and cannot be modified outside inference mode).
    return -1 if t.is_inference() else t._version


def onednn_ops(linear: OneDnnLinear) -> ModelOps:
    """The reference ops with linear; the norm, the activation and rotary with the K/V store
    through kernels.cpu_layer_ops where it serves (one pass each)."""
    norm_linear = compose_norm_linear(_rms_norm, linear)
    reference_qkv = compose_norm_qkv_rotary_store(norm_linear, REFERENCE_OPS.rotary_store)

    def norm_qkv_rotary_store(h: torch.Tensor, residual: torch.Tensor | None,
                              norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              bias: torch.Tensor | None, positions: torch.Tensor,
                              cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, backend: AttentionBackend,
                              heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel stores K/V itself: only for the torch backend's pool (store_kv's layout).
        if not (backend.name == "torch" and k_cache.dtype == h.dtype and h.dim() == 2
                and cpu_layer_ops.serves(h)):
            return reference_qkv(h, residual, norm_weight, eps, weight, bias, positions,
                                 cos_sin, k_cache, v_cache, meta, backend, heads)
        qkv, residual = norm_linear(h, residual, norm_weight, eps, weight, bias)
        q = cpu_layer_ops.rotary_store(qkv, heads[0], heads[1], positions, cos_sin, k_cache,
                                       v_cache, meta.slot_mapping)
        return q, residual

    return dataclasses.replace(
        REFERENCE_OPS, rms_norm=_rms_norm, silu_and_mul=_silu_and_mul, linear=linear,
        norm_linear=norm_linear, act_linear=compose_act_linear(_silu_and_mul, linear),
        norm_qkv_rotary_store=norm_qkv_rotary_store)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if cpu_layer_ops.serves(x) and weight.device.type == "cpu":
        return cpu_layer_ops.rms_norm(x, weight, eps, residual)
    return REFERENCE_OPS.rms_norm(x, weight, eps, residual)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if cpu_layer_ops.serves(x):
        return cpu_layer_ops.silu_and_mul(x)
    return REFERENCE_OPS.silu_and_mul(x)


def resolve_cpu_linear(name: str) -> str:
    """EngineConfig.cpu_linear -> "onednn" or "torch"."""
    if name == "auto":
        return "onednn" if onednn_available() else "torch"
    if name == "onednn" and not onednn_available():
        raise ValueError("cpu_linear onednn: this torch build or CPU has no usable oneDNN")
    return name


def install_cpu_ops(model: nn.Module, cpu_linear: str) -> None:
    """Sets model.ops for the CPU per cpu_linear. For oneDNN, packs the weights of its
    nn.Linear layers and its logits weight (model.logits_weight, the embedding table when tied;
    in float32). A float32 projection's packed copy becomes its only one where packed_linear
    reads it (hold_packed_only: the module's weight a stand-in, dense_weight() its values);
    the logits weight stays beside its packed copy (the embedding reads the table, small_linear
    a row at a time, and tests scale an lm_head in place). A model with fp8 weights
    (common.models.fp8) takes the reference ops: a packed copy would be the dequantized
    weights, the memory that fp8 saves. Leaving oneDNN for the reference ops gives the
    projections their dense weights back."""
    current = model.ops.linear
    if resolve_cpu_linear(cpu_linear) == "torch" or is_quantized(model):
        restore_dense_weights(model)
        model.ops = REFERENCE_OPS
        return
    if isinstance(current, OneDnnLinear):  # a second runner on the same model
        return
    restore_dense_weights(model)
    linear = OneDnnLinear()
    head = getattr(model, "logits_weight", None)
    if isinstance(head, torch.Tensor):
        linear.wide_output(head)
        if packable(head):
            linear.pack(head, torch.float32)
    for m in model.modules():  # an untied lm_head's float32 packing is reused
        if not (isinstance(m, nn.Linear) and packable(m.weight)):
            continue
        if m.weight is head or not linear.hold_packed_only(m):
            linear.pack(m.weight)
    model.ops = onednn_ops(linear)

"""Checkpoints that already hold FP8 weights, in the two layouts vLLM serves: which schemes load,
and where each checkpoint tensor of one goes.

config.json's `quantization_config` says which (read_scheme; None: an unquantized checkpoint):

    quant_method "compressed-tensors"   (llm-compressor's FP8 / FP8_DYNAMIC)
        config_groups.*.weights            num_bits 8, type float, symmetric, strategy
                                           channel or tensor
        config_groups.*.input_activations  absent, or 8-bit float (dynamic per token, or
                                           static: see below)
        format                             float-quantized (or naive-quantized)
    quant_method "fp8"                     (vLLM's own; AutoFP8)
        activation_scheme                  dynamic or static, and no weight_block_size

Tensors: every decoder projection is `<proj>.weight` [N, K] in float8_e4m3fn with
`<proj>.weight_scale` in float32 (or 16-bit float), [N, 1] or [N] per output channel, [1] or []
per tensor; W = weight * weight_scale. Everything else (embedding, norms, lm_head: the `ignore`
list) is in full precision as in any checkpoint.

Each projection becomes an `Fp8Linear` (common.models.fp8) filled as it is read, never
quantized again, so the engine runs it exactly as one quantized at load:

    q/k/v, gate/up   fused as the full-precision ones are (each source tensor's rows at its
                     offset), each bringing its own scales: per-channel scales concatenate, a
                     per-tensor scale is repeated over its tensor's rows
    TP, column-      a rank reads its rows of the weight and the same rows of the scale
    parallel (qkv, gate|up)
    TP, row-         a rank reads its columns of the weight and all the rows' scales: a scale
    parallel (o, down)  belongs to a whole row, so the rank's columns dequantize exactly (the
                     online path instead quantizes each rank's columns alone; a checkpoint's
                     fp8 values are kept as they are)

Refused with a ConfigError naming the scheme: block-wise scales (vLLM's `weight_block_size`,
compressed-tensors strategy block, or group), integer weights or activations (int8, int4),
asymmetric weights (zero points), output activations, a KV cache scheme (k/v scales; the pool's
fp8 is --kv-cache-dtype), and sparsity. A projection that is not fp8 or lacks its
weight_scale, or an fp8 tensor in a checkpoint that declares no scheme, fails the load (see
common.models.weights). Static activation scales (`input_scale`) are read past: activations are
quantized per token when they are (CUDA, above batch 1), which is finer than one scale per
tensor, and not at all on CPU; the weights load exactly either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from common.errors import ConfigError
from common.models.fp8 import Fp8Linear, Fp8Weight, replace_projections
from common.models.llama import LlamaModel, WeightTarget

CHANNEL, TENSOR = "channel", "tensor"
SCALE_SUFFIX = ".weight_scale"
INPUT_SCALE_SUFFIX = ".input_scale"
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


class Fp8Scheme(NamedTuple):
    """An accepted FP8 checkpoint: its quant_method and the weight scale strategies it
    declares (CHANNEL, TENSOR)."""
    method: str
    strategies: frozenset[str]


class ScaleTarget(NamedTuple):
    """Where a projection's weight_scale goes: rows [start, end) of `scale` take the source's
    rows [src_start, src_start + end - start) (a per-channel scale of `rows` rows), or its one
    value (a per-tensor scale)."""
    scale: torch.Tensor  # [N on this rank] float32
    start: int
    end: int
    rows: int            # the checkpoint tensor's rows
    src_start: int


def read_scheme(model_dir: Path) -> Fp8Scheme | None:
    """The FP8 scheme of the checkpoint in model_dir (None: it declares no quantization); a
    ConfigError for a quantization that does not load (see the module docstring)."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return parse_scheme(hf.get("quantization_config") or hf.get("compression_config"),
                        str(model_dir))


def parse_scheme(qc: dict[str, Any] | None, where: str) -> Fp8Scheme | None:
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "fp8":
        return _vllm_fp8(qc, where)
    raise ConfigError(f"{where}: quant_method {method!r} is not supported (only FP8 "
                      "checkpoints: compressed-tensors or fp8)")


def _vllm_fp8(qc: dict[str, Any], where: str) -> Fp8Scheme:
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{where}: fp8 checkpoint with {what} is not supported")

    if qc.get("weight_block_size"):
        raise refuse(f"block-wise weight scales (weight_block_size {qc['weight_block_size']})")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise refuse(f"activation_scheme {qc['activation_scheme']!r}")
    if qc.get("kv_cache_quant_method") or qc.get("kv_cache_scheme"):
        raise refuse("a KV cache scheme (use --kv-cache-dtype fp8)")
    return Fp8Scheme("fp8", frozenset((CHANNEL, TENSOR)))


def _compressed_tensors(qc: dict[str, Any], where: str) -> Fp8Scheme:
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{where}: compressed-tensors checkpoint with {what} is not supported "
                           "(only FP8 weights, 8-bit float, one scale per channel or tensor)")

    fmt = qc.get("format")
    if fmt is not None and fmt not in _FLOAT_FORMATS:
        raise refuse(f"format {fmt!r}")
    if qc.get("kv_cache_scheme"):
        raise refuse("a kv_cache_scheme (use --kv-cache-dtype fp8)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise refuse(f"sparsity format {sparsity['format']!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("no config_groups")
    strategies = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (w.get("type"), w.get("num_bits")) != ("float", 8):
            raise refuse(f"{name}: {w.get('num_bits')}-bit {w.get('type')} weights")
        if w.get("strategy") not in (CHANNEL, TENSOR):
            scales = ("block-wise scales" if w.get("strategy") == "block" or w.get(
                "block_structure") else f"weight strategy {w.get('strategy')!r}")
            raise refuse(f"{name}: {scales}")
        if not w.get("symmetric", True) or w.get("dynamic"):
            raise refuse(f"{name}: {'dynamic' if w.get('dynamic') else 'asymmetric'} weights")
        a = group.get("input_activations")
        if a and (a.get("type"), a.get("num_bits")) != ("float", 8):
            raise refuse(f"{name}: {a.get('num_bits')}-bit {a.get('type')} input activations")
        if group.get("output_activations"):
            raise refuse(f"{name}: quantized output activations")
        strategies.add(w["strategy"])
    return Fp8Scheme("compressed-tensors", frozenset(strategies))


def prepare_model(model: LlamaModel) -> None:
    """Give model empty fp8 projections for the checkpoint's to fill (before
    hf_weight_targets)."""
    replace_projections(model, Fp8Linear.empty_like)


def checkpoint_targets(targets: dict[str, WeightTarget]
                       ) -> dict[str, WeightTarget | ScaleTarget]:
    """model.hf_weight_targets() of a prepared model -> the fp8 checkpoint's tensor names: each
    projection's `.weight` into its qweight rows, and its `.weight_scale` into its scale's."""
    out: dict[str, WeightTarget | ScaleTarget] = {}
    for name, t in targets.items():
        if not isinstance(t.param, Fp8Weight):
            out[name] = t
            continue
        out[name] = t._replace(param=t.param.qweight)
        # A row-parallel weight (src_dim 1) keeps all its rows: their whole scales.
        out[name.removesuffix(".weight") + SCALE_SUFFIX] = ScaleTarget(
            t.param.scale, t.start, t.end, t.full[0], t.src_start if t.src_dim == 0 else 0)
    return out


def copy_scale(t: ScaleTarget, source: torch.Tensor, scheme: Fp8Scheme, what: str) -> None:
    """scale[start:end] = this target's rows of source, a checkpoint weight_scale."""
    shape = tuple(source.shape)
    if not source.is_floating_point() or source.dtype == torch.float8_e4m3fn:
        raise ValueError(f"{what} is {source.dtype}, expected float32 scales")
    if shape in ((), (1,)):
        strategy = TENSOR
    elif shape in ((t.rows,), (t.rows, 1)):
        strategy = CHANNEL
    else:
        raise ValueError(f"{what} has shape {shape}: expected [{t.rows}, 1] or [{t.rows}] (one "
                         "scale per output channel) or [1] / [] (one per tensor); block-wise "
                         "scales are not supported")
    if strategy not in scheme.strategies:
        raise ValueError(f"{what} is a per-{strategy} scale, but the {scheme.method} config "
                         f"declares {', '.join(sorted(scheme.strategies))}")
    rows = t.scale[t.start:t.end]
    if strategy == TENSOR:
        rows.copy_(source.reshape(()).expand(rows.shape))
    else:
        rows.copy_(source.reshape(-1)[t.src_start:t.src_start + rows.shape[0]])

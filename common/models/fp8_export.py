"""Writing an FP8 checkpoint from a full-precision one, in a layout common.models.fp8_checkpoint
(and vLLM) loads: for the tests, and to try an FP8 checkpoint without llm-compressor.

    python -m common.models.fp8_export --model SmolLM2-135M-Instruct --out DIR \
        [--format compressed-tensors|fp8]

Each decoder projection (q, k, v, o, gate, up, down: separate tensors, as HF stores them)
becomes `.weight` in float8_e4m3fn and `.weight_scale` in float32 through
kernels.torch_ops.quantize_rows, the function --quantization fp8 quantizes with:

    compressed-tensors   one scale per output channel, [N, 1]: the fp8 values and scales are
                         bit for bit what --quantization fp8 makes of the same weights (rows
                         are quantized alone, so fusing q|k|v first changes nothing)
    fp8                  vLLM's plain fp8, one scale per tensor, []: amax over the whole tensor

The embedding, the norms and lm_head are copied as they are (the config's ignore list names
lm_head), with config.json (plus its quantization_config) and every other non-weight file
(tokenizer, generation config).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.models import fp8_checkpoint
from common.models.loader import resolve_model
from common.models.weights import safetensors_files
from kernels import torch_ops

FORMATS = ("compressed-tensors", "fp8")
_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                         r"\.weight")


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 [N, K], its scale: [N, 1] per channel, [] per tensor for fp8)."""
    if fmt == "compressed-tensors":
        return torch_ops.quantize_rows(weight)
    q, scale = torch_ops.quantize_rows(weight.reshape(1, -1))
    return q.view(weight.shape), scale.reshape(())


def quantization_config(fmt: str) -> dict[str, Any]:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "ignored_layers": ["lm_head"]}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**fp8, "strategy": "channel", "dynamic": False},
            "input_activations": {**fp8, "strategy": "token", "dynamic": True},
        }},
    }


def export_fp8(src: Path, out: Path, fmt: str = "compressed-tensors") -> Path:
    """Write src (a full-precision HF directory) to out in fmt (FORMATS); returns out."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fp8_checkpoint.read_scheme(src) is not None:
        raise ValueError(f"{src} is already quantized")
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(src):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = f.get_tensor(name)
                if _PROJECTION.fullmatch(name):
                    q, scale = quantize(t, fmt)
                    tensors[name] = q.contiguous()
                    tensors[name.removesuffix(".weight") + fp8_checkpoint.SCALE_SUFFIX] = scale
                else:
                    tensors[name] = t
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, out / path.name)
    return out


def main(argv: list[str] | None = None) -> None:
    from common.engine.config import DEFAULT_CACHE_DIR, DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="python -m common.models.fp8_export",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a HF directory, a .gguf file or SmolLM2-135M-Instruct")
    p.add_argument("--out", type=Path, required=True, help="the directory to write")
    p.add_argument("--format", choices=FORMATS, default=FORMATS[0],
                   help="compressed-tensors: a scale per output channel; fp8: vLLM's, a scale "
                        "per tensor")
    p.add_argument("--model-cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                   help="where converted (GGUF -> safetensors) models are cached")
    args = p.parse_args(argv)
    out = export_fp8(resolve_model(args.model, args.model_cache_dir), args.out, args.format)
    print(f"wrote {args.format} checkpoint to {out}")


if __name__ == "__main__":
    main()

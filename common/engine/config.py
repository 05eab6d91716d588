"""The engine's one frozen config, validated at construction; every field is also a CLI flag."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "splitserve"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None
    dtype: str = "auto"                 # auto -> float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                # auto -> cuda if available, else cpu
    attention_backend: str = "auto"     # auto -> triton on CUDA, torch on CPU
    block_size: int = 16
    num_kv_blocks: int | None = None    # explicit pool size; else from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.9
    cpu_kv_cache_gib: float = 4.0       # KV pool size on CPU when num_kv_blocks is not given
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None    # None -> the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    model_cache_dir: str = str(DEFAULT_CACHE_DIR)
    seed: int = 0
    cpu_threads: int = 0                # torch intra-op threads on CPU; 0 = torch's default
    cpu_linear: str = "auto"            # auto -> onednn where available, else torch
    speculative_method: str | None = None  # None (off), "ngram" or "draft"
    speculative_model: str | None = None   # the draft model (method "draft")
    num_speculative_tokens: int = 6
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    overlap_scheduling: str = "auto"    # auto -> on for CUDA, off on CPU
    cuda_graph_prefill_tokens: int = 1024  # prefill/mixed steps up to this many tokens replay graphs

    HELP = {
        "model": "model: a HF directory, a .gguf file, SmolLM2-135M-Instruct, or dummy:<shape>",
        "served_model_name": "name clients use for the model (default: derived from --model)",
        "dtype": "weights and KV dtype: auto, float32, bfloat16, float16",
        "device": "auto, cpu or cuda[:N]",
        "attention_backend": "auto, torch (reference ops) or triton",
        "block_size": "tokens per KV block",
        "num_kv_blocks": "KV pool size in blocks (overrides --kv-cache-memory-fraction)",
        "kv_cache_memory_fraction": "fraction of free GPU memory after weights given to the KV pool",
        "cpu_kv_cache_gib": "KV pool size in GiB on CPU (when --num-kv-blocks is not given)",
        "max_num_seqs": "most sequences in one batch",
        "max_num_batched_tokens": "token budget of one step (chunked prefill splits longer prompts)",
        "max_model_len": "longest prompt + output (default: the model's)",
        "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
        "enable_chunked_prefill": "split long prompts across steps and mix them with decodes",
        "model_cache_dir": "where converted (GGUF -> safetensors) models are cached",
        "seed": "seed for dummy weights and unseeded sampling",
        "cpu_threads": "torch threads on CPU (0: one per core); give each service its share "
                       "when several run on one machine",
        "cpu_linear": "CPU matmuls of the projections: onednn (weights packed once for oneDNN; "
                      "faster at 1-64 rows, but holds a second copy of the weights, doubling "
                      "their memory), torch (F.linear), or auto (onednn where available)",
        "speculative_method": "speculative decoding: ngram (prompt lookup) or draft (a smaller "
                              "model, --speculative-model); default off",
        "speculative_model": "draft model for --speculative-method draft (same tokenizer and "
                             "vocabulary as --model; same spec forms as --model)",
        "num_speculative_tokens": "draft tokens proposed per sequence and step (k)",
        "prompt_lookup_min": "ngram: shortest suffix n-gram looked up in the prompt and output",
        "prompt_lookup_max": "ngram: longest suffix n-gram looked up (tried first)",
        "cuda_graph_prefill_tokens": "CUDA: capture graphs for prefill and mixed steps of up to "
                                     "this many tokens (0: such steps run eagerly)",
        "overlap_scheduling": "schedule and prepare step N+1 while step N runs on the device: "
                              "auto (on for CUDA), on or off",
    }

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if self.cpu_linear not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_linear must be auto, onednn or torch, got {self.cpu_linear!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.speculative_method!r} "
                             "(ngram or draft)")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("--speculative-model goes with --speculative-method draft")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1, "
                             f"got {self.num_speculative_tokens}")
        if self.cuda_graph_prefill_tokens < 0:
            raise ValueError("cuda_graph_prefill_tokens must be >= 0")
        if self.overlap_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"overlap_scheduling must be auto, on or off, "
                             f"got {self.overlap_scheduling!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model.startswith("dummy:"):
            return self.model
        return Path(self.model).name.removesuffix(".gguf") if "/" in self.model else self.model

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.name == "HELP":
                continue
            flag = "--" + f.name.replace("_", "-")
            default = getattr(defaults, f.name)
            if isinstance(default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=cls.HELP[f.name])
            else:
                kind = {"int": int, "float": float}.get(
                    str(f.type).replace(" | None", ""), str)
                group.add_argument(flag, type=kind, default=default, help=cls.HELP[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)

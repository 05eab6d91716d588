"""The engine's config: one frozen dataclass per concern, validated at construction, each field a
flag (`common.flags`) with its help beside it.

    EngineConfig
    ├── model:       ModelSettings     which weights, dtype, device, CPU execution
    ├── cache:       CacheConfig       the paged KV pool and the prefix cache
    ├── scheduler:   SchedulerConfig   batch limits, chunked prefill, overlap (engine/core)
    ├── speculative: SpeculativeConfig n-gram or draft-model speculation
    ├── cuda_graphs: CudaGraphConfig   which steps replay CUDA graphs
    └── parallel:    ParallelConfig    tensor parallelism (ranks, collective timeout)

Tests and scripts build one from flag names: `build(EngineConfig, model="dummy:tiny-llama",
num_kv_blocks=64)`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.engine.core.scheduler import SchedulerConfig
from common.flags import add_args, from_args, group, opt

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "splitserve"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def served_model_name(model: str, served_model_name: str | None) -> str:
    """What clients call the model: --served-model-name, else --model's last path part without
    .gguf (a dummy:<shape> spec as it is). The engine and the gateway both name it so."""
    if served_model_name:
        return served_model_name
    if model.startswith("dummy:"):
        return model
    return model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    name: str = opt(DEFAULT_MODEL, "model: a HF directory, a .gguf file, SmolLM2-135M-Instruct, "
                    "or dummy:<shape>", flag="model")
    served_model_name: str | None = opt(
        None, "name clients use for the model (default: derived from --model)")
    dtype: str = opt("auto", "weights and KV dtype: auto (float32 on CPU, bfloat16 on CUDA), "
                     "float32, bfloat16, float16")
    device: str = opt("auto", "auto (cuda if available), cpu or cuda[:N]")
    attention_backend: str = opt("auto", "auto (triton on CUDA, torch on CPU), torch "
                                 "(reference ops) or triton")
    model_cache_dir: str = opt(str(DEFAULT_CACHE_DIR),
                               "where converted (GGUF -> safetensors) models are cached")
    quantization: str | None = opt(
        None, "fp8: quantize the projections' weights to FP8 (e4m3) at load, one scale per "
        "output channel (common/models/fp8.py); on CUDA with activations quantized per token "
        "(torch._scaled_mm) above batch 1; default: none (the checkpoint's precision)")
    seed: int = opt(0, "seed for dummy weights and unseeded sampling")
    cpu_threads: int = opt(0, "torch threads on CPU (0: one per core); give each service its "
                           "share when several run on one machine")
    cpu_omp_spin_count: int = opt(
        -1, "CPU: how long (GOMP_SPINCOUNT) torch's OpenMP threads spin for the next op "
        "before they sleep, set when the process starts (the splitserve command does); -1: "
        "libgomp's 300000, fastest on an idle box (ShareGPT-like bf16 21.2 s against 32.4 "
        "with 1000); 1000 on a box other processes keep busy (a decode step 0.2 s against "
        "0.4-1.6)")
    cpu_linear: str = opt("auto", "CPU matmuls of the projections: onednn (weights packed once "
                          "for oneDNN, bf16 too where the CPU has bf16 kernels; the packed "
                          "copies are held beside the weights), torch (F.linear), or auto "
                          "(onednn where available)")
    grammar_warmup: bool = opt(True, "structured outputs: import xgrammar and build the "
                               "vocabulary's grammar compiler at start-up, on the compile thread, "
                               "so the first constrained request waits for no import (about 1 s "
                               "on a 2-core CPU, +64 MiB); off: on first use")

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or none, got {self.quantization!r}")
        if self.cpu_linear not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_linear must be auto, onednn or torch, got {self.cpu_linear!r}")

    @property
    def is_dummy(self) -> bool:
        return self.name.startswith("dummy:")

    @property
    def served_name(self) -> str:
        return served_model_name(self.name, self.served_model_name)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV block")
    num_kv_blocks: int | None = opt(
        None, "KV pool size in blocks (overrides --kv-cache-memory-fraction)")
    kv_cache_memory_fraction: float = opt(
        0.9, "fraction of free GPU memory after weights given to the KV pool")
    cpu_kv_cache_gib: float = opt(
        4.0, "KV pool size in GiB on CPU (when --num-kv-blocks is not given)")
    enable_prefix_caching: bool = opt(True, "reuse KV blocks of shared prompt prefixes")
    kv_cache_dtype: str = opt("auto", "KV pool dtype: auto (the model's) or fp8 (e4m3, one "
                              "scale per tensor, 1.0: half the bytes of bf16; both sides of a "
                              "handoff must agree)")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str | None = opt(None, "speculative decoding: ngram (prompt lookup) or draft (a "
                             "smaller model, --speculative-model); default off",
                             flag="speculative_method")
    model: str | None = opt(None, "draft model for --speculative-method draft (same tokenizer "
                            "and vocabulary as --model; same spec forms as --model)",
                            flag="speculative_model")
    num_tokens: int = opt(6, "draft tokens proposed per sequence and step (k)",
                          flag="num_speculative_tokens")
    prompt_lookup_min: int = opt(2, "ngram: shortest suffix n-gram looked up in the prompt and "
                                 "output")
    prompt_lookup_max: int = opt(4, "ngram: longest suffix n-gram looked up (tried first)")

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.method!r} (ngram or draft)")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("--speculative-model goes with --speculative-method draft")
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")


@dataclass(frozen=True, slots=True)
class CudaGraphConfig:
    prefill_tokens: int = opt(1024, "CUDA: capture graphs for prefill and mixed steps of up to "
                              "this many tokens (0: such steps run eagerly)",
                              flag="cuda_graph_prefill_tokens")

    def __post_init__(self) -> None:
        if self.prefill_tokens < 0:
            raise ValueError("cuda_graph_prefill_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = opt(1, "tensor parallel ranks: one process each (gloo on CPU, "
                                    "NCCL on CUDA), each holding 1/N of the heads, the MLP and "
                                    "the vocabulary; must divide the heads (KV heads are "
                                    "replicated above their count) and the vocabulary")
    tp_timeout_s: float = opt(60.0, "timeout of every tensor-parallel collective: a rank that "
                              "hangs fails the engine after it (one that dies, at once)")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be positive, got {self.tp_timeout_s}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelSettings = group(ModelSettings)
    cache: CacheConfig = group(CacheConfig, "KV cache")
    scheduler: SchedulerConfig = group(SchedulerConfig)
    speculative: SpeculativeConfig = group(SpeculativeConfig, "speculative decoding")
    cuda_graphs: CudaGraphConfig = group(CudaGraphConfig, "CUDA graphs")
    parallel: ParallelConfig = group(ParallelConfig, "tensor parallelism")

    @property
    def model_name(self) -> str:
        return self.model.served_name

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_args(cls, parser, "engine")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        return from_args(cls, args, **overrides)

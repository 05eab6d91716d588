"""`splitserve run-batch --tensor-parallel-size 3` (SmolLM2-135M, three CPU ranks): the TP 1
engine's tokens, and the command exits with its ranks stopped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build

PROMPTS = ["The capital of France is", "def add(a, b):"]

pytestmark = pytest.mark.slow


def test_run_batch_at_tp3_gives_tp1_tokens(tmp_path, model_cache_dir):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({
        "custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True}})
        + "\n" for i, p in enumerate(PROMPTS)))
    subprocess.run([sys.executable, "-m", "splitserve.cli", "run-batch", "-i", str(src),
                    "-o", str(dst), "--no-progress", "--num-kv-blocks", "64",
                    "--tensor-parallel-size", "3", "--model-cache-dir", str(model_cache_dir)],
                   check=True, timeout=300)
    got = [json.loads(x)["response"]["body"]["choices"][0]["token_ids"]
           for x in dst.read_text().splitlines()]
    engine = LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir),
                             num_kv_blocks=64))
    want = [o.output_token_ids for o in engine.generate(
        [engine.tokenizer.encode(p) for p in PROMPTS],
        SamplingParams(max_tokens=8, temperature=0))]
    assert got == want

"""Speculative decoding through the services: greedy outputs equal the plain in-process engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.stack.conftest import Stack

MAX_TOKENS = 32
# Input-grounded prompts: the answer repeats spans of the prompt, so n-gram drafts get accepted.
PROMPTS = [
    f"Repeat this list exactly, changing only item {i}: apples, pears, plums, figs, dates, limes, "
    f"grapes, melons, kiwis, mangos. Answer: apples, pears, plums, figs," for i in range(1, 9)
] + [
    f"def add_{i}(a, b):\n    return a + b\n\n# The same function, renamed to sum_{i}:\ndef sum_{i}(a, b):"
    for i in range(8)
]


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("spec-stack-logs"), num_prefill=1, num_decode=1,
              decode_flags=("--speculative-method", "ngram", "--num-speculative-tokens", "4"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def test_ngram_speculation_through_the_services_is_lossless(spec_stack, model_cache_dir):
    engine = LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), num_kv_blocks=512,
                                    cpu_threads=1))
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    with ThreadPoolExecutor(1) as pool:
        want = pool.submit(engine.generate, prompts,
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)).result()

    def run(i: int) -> list[int]:
        req = generation_pb2.GenerateStreamRequest(
            request_id=f"spec-{i}", prompt_token_ids=generation_pb2.TokenIds(ids=prompts[i]),
            params=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        return [t for m in spec_stack.stub.GenerateStream(req, timeout=300) for t in m.token_ids]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, range(len(prompts))))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w.output_token_ids, f"prompt {i} differs"
    spec_stack.wait_idle(timeout_s=10)

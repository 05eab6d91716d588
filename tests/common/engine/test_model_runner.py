"""ModelRunner's step timing hook: one record per launch, named by the path that ran it."""

from __future__ import annotations

from itertools import pairwise

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.cuda_runner import CudaGraphRunner
from common.engine.engine import LLMEngine
from common.engine.model_runner import ModelRunner, StepTiming
from common.flags import build

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _engine(runner_cls, tmp_path, **kw) -> LLMEngine:
    cfg = dict(model="dummy:tiny-llama", device="cpu", num_kv_blocks=32, block_size=4,
               max_num_batched_tokens=16, model_cache_dir=str(tmp_path))
    cfg.update(kw)
    return LLMEngine(build(EngineConfig, **cfg), runner_factory=runner_cls)


def test_timed_steps_records_each_launch(tmp_path):
    engine = _engine(ModelRunner, tmp_path)
    runner = engine.runner
    heard: list[StepTiming] = []
    runner.step_listeners.append(heard.append)
    with runner.timed_steps() as timings:
        # Step 1: 16 of the first prompt's 20 tokens; 2: its last 4 and the second prompt (both
        # sample); 3 and 4: two decodes.
        engine.generate([[5] * 20, [7] * 3], GREEDY)
    assert [t.kind for t in timings] == ["eager"] * 4 == [t.kind for t in heard]
    assert runner.steps == {"eager": 4}
    assert all(t.seconds >= 0 for t in timings)
    assert all(t.end <= u.start for t, u in pairwise(timings))
    assert runner.step_listeners == [heard.append]  # timed_steps() took only its own
    engine.generate([[9] * 3], GREEDY)
    assert len(timings) == 4 and len(heard) == 7


def test_cuda_runner_kinds(tmp_path):
    """On the CPU CudaGraphRunner runs prefills on its buffers ("eager") and sends
    verification steps to ModelRunner.run_step ("fallback")."""
    # The target as its own draft: every decode step verifies drafts.
    engine = _engine(CudaGraphRunner, tmp_path, speculative_method="draft",
                     speculative_model="dummy:tiny-llama", num_speculative_tokens=2)
    runner = engine.runner
    with runner.timed_steps() as timings:
        # A prefill, then two steps that each accept both drafts and sample one more.
        engine.generate([[5, 6, 7, 8] * 3], SamplingParams(max_tokens=7, temperature=0.0,
                                                           ignore_eos=True))
    assert [t.kind for t in timings] == ["eager", "fallback", "fallback"]
    assert runner.steps == {"graph": 0, "prefill_graph": 0, "eager": 1, "fallback": 2}

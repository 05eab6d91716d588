"""Tensor parallelism on CPU ranks (gloo): the shard arithmetic and its errors, each rank loading
only its slices, and engines at TP 2 and 4 (dummy:tiny-llama) giving the greedy tokens of TP 1
and of HF transformers in float32, with prefix caching, chunked prefill, preemption and overlap
placeholders exercised; a rank that dies or hangs fails the engine instead of hanging it.
(SmolLM2-135M at TP 3: test_tensor_parallel_smollm2.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.errors import ConfigError, RankFailure
from common.flags import build
from common.models.dummy import dummy_config
from common.models.loader import load_model
from common.models.sharding import Shard, shard_layout

TINY = "dummy:tiny-llama"  # 4 heads, 2 KV heads, MLP 128, vocabulary 512
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def tiny_prompts() -> list[list[int]]:
    """Six prompts of 5 to 47 tokens; the last two share a 24-token prefix with the first."""
    base = [(i * 37 + 11) % 509 + 1 for i in range(24)]
    return [base + [7, 300, 41], [3, 99, 250, 17, 480],
            [(i * 13 + 5) % 500 + 2 for i in range(47)], [100 + i for i in range(19)],
            base + [8, 8, 8, 200], base + [1, 2]]


# ---- the shard arithmetic ------------------------------------------------------------------
def test_layout_splits_heads_and_replicates_kv_heads():
    c = dummy_config("smollm2-135m")  # 9 heads, 3 KV heads
    lays = [shard_layout(c, Shard(r, 3)) for r in range(3)]
    assert [(x.num_heads, x.head_start, x.num_kv_heads, x.kv_head_start) for x in lays] == [
        (3, 0, 1, 0), (3, 3, 1, 1), (3, 6, 1, 2)]
    assert [x.vocab_start for x in lays] == [0, 16384, 32768]
    tiny = dummy_config("tiny-llama")  # 4 heads, 2 KV heads: at TP 4 each KV head on 2 ranks
    assert [shard_layout(tiny, Shard(r, 4)).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert {shard_layout(tiny, Shard(r, 4)).num_kv_heads for r in range(4)} == {1}


@pytest.mark.parametrize(("size", "message"), [
    (2, "tensor parallel size 2 does not divide the 9 attention heads"),
    (6, "tensor parallel size 6 does not divide the 9 attention heads"),
])
def test_size_that_does_not_divide_the_heads_is_a_config_error(size, message):
    with pytest.raises(ConfigError, match=message):
        shard_layout(dummy_config("smollm2-135m"), Shard(0, size))


def test_kv_heads_and_vocabulary_must_divide():
    c = replace(dummy_config("tiny-llama"), num_heads=12, num_kv_heads=4, head_dim=16)
    with pytest.raises(ConfigError, match="size 3 does not divide the 4 KV heads"):
        shard_layout(c, Shard(0, 3))
    with pytest.raises(ConfigError, match="size 6 is not a multiple of the 4 KV heads"):
        shard_layout(c, Shard(0, 6))
    odd_vocab = replace(dummy_config("tiny-llama"), vocab_size=510)
    with pytest.raises(ConfigError, match=r"size 4 does not divide the vocabulary .*510 tokens"):
        shard_layout(odd_vocab, Shard(0, 4))


def test_engine_refuses_before_starting_any_rank(model_cache_dir):
    with pytest.raises(ConfigError, match="size 2 does not divide the 9 attention heads"):
        LLMEngine(build(EngineConfig, model="SmolLM2-135M-Instruct", tensor_parallel_size=2,
                        model_cache_dir=str(model_cache_dir), num_kv_blocks=16))


# ---- each rank's slices ---------------------------------------------------------------------
def _hf_tensors(model) -> dict[str, torch.Tensor]:
    return {name: t.param[t.start:t.end] for name, t in model.hf_weight_targets().items()}


def _slice(full: torch.Tensor, t) -> torch.Tensor:
    n = t.end - t.start if t.src_dim == 0 else t.param.shape[1]
    return full.narrow(t.src_dim, t.src_start, n)


@pytest.mark.parametrize(("spec", "size"), [(TINY, 4), ("SmolLM2-135M-Instruct", 3)])
def test_each_rank_holds_its_slice_of_every_tensor(spec, size, model_cache_dir):
    whole, _ = load_model(spec, dtype=torch.float32, device=torch.device("cpu"),
                          cache_dir=model_cache_dir)
    full = _hf_tensors(whole)
    for rank in range(size):
        part, _ = load_model(spec, dtype=torch.float32, device=torch.device("cpu"),
                             cache_dir=model_cache_dir, shard=Shard(rank, size))
        targets = part.hf_weight_targets()
        assert set(targets) == set(full)
        for name, t in targets.items():
            assert torch.equal(t.param[t.start:t.end], _slice(full[name], t)), (rank, name)


# ---- engines at TP 1, 2 and 4 ---------------------------------------------------------------
def tiny_engine(model_cache_dir, tp: int, **kw) -> LLMEngine:
    cfg = dict(model=TINY, model_cache_dir=str(model_cache_dir), tensor_parallel_size=tp,
               block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, cpu_threads=1)
    cfg.update(kw)
    return LLMEngine(build(EngineConfig, **cfg))


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """The first prompt alone (its blocks then cached), then all of them together."""
    first = engine.generate(prompts[:1], GREEDY)[0].output_token_ids
    outs = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
    assert outs[0] == first
    return outs


@pytest.fixture(scope="module")
def tp1_tokens(model_cache_dir) -> list[list[int]]:
    engine = tiny_engine(model_cache_dir, 1, num_kv_blocks=400, max_num_batched_tokens=512)
    return run(engine, tiny_prompts())


@pytest.fixture(scope="module")
def hf_tokens(model_cache_dir) -> list[list[int]]:
    """HF transformers' LlamaForCausalLM with the same weights, float32, greedy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ours, c = load_model(TINY, dtype=torch.float32, device=torch.device("cpu"),
                         cache_dir=model_cache_dir)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=False))
    missing, unexpected = hf.load_state_dict(_hf_tensors(ours), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    outs = []
    with torch.inference_mode():
        for ids in tiny_prompts():
            y = hf.float().eval().generate(torch.tensor([ids]), do_sample=False,
                                           max_new_tokens=GREEDY.max_tokens,
                                           min_new_tokens=GREEDY.max_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def test_tp1_matches_hf(tp1_tokens, hf_tokens):
    assert tp1_tokens == hf_tokens


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_match_tp1_and_hf(model_cache_dir, tp, tp1_tokens, hf_tokens):
    """A pool of 40 blocks of 4 tokens and a 24-token budget: prompts are chunked, the repeated
    prefix is a cache hit, and six sequences of up to 63 tokens preempt each other."""
    engine = tiny_engine(model_cache_dir, tp)
    try:
        hits = engine.block_manager.prefix_hits
        assert run(engine, tiny_prompts()) == tp1_tokens == hf_tokens
        assert engine.block_manager.prefix_hits > hits
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.close()


def test_overlap_placeholders_reach_every_rank(model_cache_dir, tp1_tokens):
    """Overlap scheduling: a decode's token is still on rank 0 when the next step is launched;
    the ranks get the step's input ids by broadcast."""
    engine = tiny_engine(model_cache_dir, 2, overlap_scheduling="on", num_kv_blocks=400,
                         max_num_batched_tokens=512)
    try:
        assert engine.overlap
        assert run(engine, tiny_prompts()) == tp1_tokens
    finally:
        engine.close()


# ---- failures ---------------------------------------------------------------------------------
def _long_request(engine: LLMEngine) -> None:
    engine.add_request("r", [5] * 20, SamplingParams(max_tokens=100, temperature=0.0,
                                                     ignore_eos=True))


def test_a_rank_that_dies_fails_the_engine_and_close_ends_the_others(model_cache_dir):
    engine = tiny_engine(model_cache_dir, 4, tp_timeout_s=30.0)
    try:
        _long_request(engine)
        engine.step()
        os.kill(engine.ranks.procs[1].pid, signal.SIGKILL)  # rank 2
        start = time.monotonic()
        with pytest.raises(RankFailure):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 10  # at once, not after the 30 s timeout
    finally:
        engine.close()
    assert all(p.poll() is not None for p in engine.ranks.procs)


def test_a_rank_that_hangs_fails_the_engine_after_the_timeout(model_cache_dir):
    engine = tiny_engine(model_cache_dir, 2, tp_timeout_s=2.0)
    rank1 = engine.ranks.procs[0]
    try:
        _long_request(engine)
        engine.step()
        os.kill(rank1.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 0 of 2"):
            engine.step()
        assert 1.5 < time.monotonic() - start < 15
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
        engine.close()
    assert rank1.poll() is not None


def test_ranks_exit_when_rank_0_is_killed(model_cache_dir, tmp_path):
    """Rank 0 SIGKILLed (no close()): the other ranks see their pipe close and exit."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\n"
        "from common.engine.config import EngineConfig\n"
        "from common.engine.engine import LLMEngine\n"
        "from common.flags import build\n"
        f"e = LLMEngine(build(EngineConfig, model={TINY!r}, tensor_parallel_size=2, "
        f"num_kv_blocks=16, cpu_threads=1, model_cache_dir={str(model_cache_dir)!r}))\n"
        "print(e.ranks.procs[0].pid, flush=True)\n"
        "time.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd())
    try:
        rank1 = int(rank0.stdout.readline())
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(rank1, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{rank1}/stat") as f:
            if f.read().split(") ")[-1].startswith("Z"):  # exited, not yet reaped
                return
        time.sleep(0.2)
    os.kill(rank1, signal.SIGKILL)
    pytest.fail("rank 1 outlived rank 0 by 20 s")

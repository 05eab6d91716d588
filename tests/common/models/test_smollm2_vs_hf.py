"""Our SmolLM2-135M (converted from the bundled GGUF) against HF transformers, float32 on CPU."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.models.llama import LlamaModel
from common.models.loader import load_model

PROMPT = ("The city of Paris is the capital of France. It is known for the Eiffel Tower, "
          "the Louvre museum, and its small cafes on quiet streets. Many tourists visit every "
          "single year because")
OTHER_PROMPTS = ("def fibonacci(n):\n    if n < 2:", "Water boils at a temperature of")


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path, model_cache_dir: Path) -> LlamaModel:
    model, _ = load_model(str(smollm2_dir), dtype=torch.float32, device=torch.device("cpu"),
                          cache_dir=model_cache_dir)
    return model


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenize(smollm2_dir: Path):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def prompt_ids(tokenize) -> list[int]:
    ids = tokenize(PROMPT)
    assert 35 <= len(ids) <= 45
    return ids


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match_hf(ours, hf, prompt_ids, paged_runner):
    (logits,) = paged_runner(ours).step([(0, prompt_ids)])
    ref = hf_logits(hf, prompt_ids)
    assert (logits[-1] - ref[-1]).abs().max().item() < 1e-3
    assert (logits - ref).abs().max().item() < 1e-3


def test_greedy_decode_matches_hf_generate(ours, hf, prompt_ids, paged_runner):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=10,
                          min_new_tokens=10, pad_token_id=hf.config.eos_token_id)
    expected = out[0, len(prompt_ids):].tolist()
    runner = paged_runner(ours)
    (logits,) = runner.step([(0, prompt_ids)])
    tokens = [int(logits[-1].argmax())]
    for _ in range(9):
        (logits,) = runner.step([(0, tokens[-1:])])
        assert runner.last_meta.num_decodes == 1
        tokens.append(int(logits[-1].argmax()))
    assert tokens == expected


def test_chunked_prefill_gives_same_logits(ours, hf, prompt_ids, paged_runner):
    full = paged_runner(ours).step([(0, prompt_ids)])[0]
    runner = paged_runner(ours)
    cuts = [0, 7, 27, len(prompt_ids)]  # chunks of 7, 20 and the rest; 27 splits a block
    chunks = [runner.step([(0, prompt_ids[a:b])])[0] for a, b in pairwise(cuts)]
    chunked = torch.cat(chunks)
    assert (chunked - full).abs().max().item() < 1e-4
    assert (chunked[-1] - hf_logits(hf, prompt_ids)[-1]).abs().max().item() < 1e-3


def _one_by_one(model, paged_runner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Per prompt: last-token logits of its prefill followed by `steps` greedy decodes."""
    results = []
    for ids in prompts:
        runner = paged_runner(model)
        rows = [runner.step([(0, ids)])[0][-1]]
        for _ in range(steps):
            rows.append(runner.step([(0, [int(rows[-1].argmax())])])[0][-1])
        results.append(torch.stack(rows))
    return results


def test_batched_prefill_and_decode_equal_one_by_one(ours, prompt_ids, tokenize, paged_runner):
    prompts = [prompt_ids] + [tokenize(p) for p in OTHER_PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    expected = _one_by_one(ours, paged_runner, prompts, steps=3)
    runner = paged_runner(ours)
    rows = [[lg[-1]] for lg in runner.step(list(enumerate(prompts)))]
    assert runner.last_meta.num_decodes == 0
    for _ in range(3):
        step = [(i, [int(r[-1].argmax())]) for i, r in enumerate(rows)]
        for r, lg in zip(rows, runner.step(step), strict=True):
            r.append(lg[-1])
        assert runner.last_meta.num_decodes == 3
    for got, want in zip(rows, expected, strict=True):
        got = torch.stack(got)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert (got - want).abs().max().item() < 1e-4


def test_mixed_decode_and_chunked_prefill_step(ours, prompt_ids, tokenize, paged_runner):
    prompts = [prompt_ids, tokenize(OTHER_PROMPTS[0]), tokenize(OTHER_PROMPTS[1])]
    expected = _one_by_one(ours, paged_runner, prompts, steps=2)
    a, b, c = prompts
    runner = paged_runner(ours)
    rows: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def run(chunks: list[tuple[int, list[int]]], num_decodes: int, collect: set[int]) -> None:
        for (seq, _), logits in zip(chunks, runner.step(chunks), strict=True):
            if seq in collect:
                rows[seq].append(logits[-1])
        assert runner.last_meta.num_decodes == num_decodes

    def decode(seq: int) -> tuple[int, list[int]]:
        return seq, [int(rows[seq][-1].argmax())]

    run([(0, a[:25]), (1, b)], 0, {1})                  # a's first chunk, b's prompt
    run([decode(1), (0, a[25:]), (2, c)], 1, {0, 1, 2})  # b decode leads two prefills
    run([decode(1), decode(0), decode(2)], 3, {0, 1, 2})
    run([decode(0), decode(2)], 2, {0, 2})
    for seq, want in enumerate(expected):
        got = torch.stack(rows[seq])
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert (got - want).abs().max().item() < 1e-4

"""kernels.argmax.argmax_rows against torch.argmax(dim=-1): the same indices, ties and NaN included."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_rows

F32, BF16 = torch.float32, torch.bfloat16

# (device, rows, vocab, dtype): vocab below, at and across the 4096-entry chunks.
CASES = [
    pytest.param("cpu", 3, 50, F32, id="cpu-one-chunk"),
    pytest.param("cpu", 2, 9000, F32, id="cpu-three-chunks"),
    pytest.param("cuda", 1, 128256, F32, id="cuda-b1-llama3", marks=pytest.mark.gpu),
    pytest.param("cuda", 256, 128256, F32, id="cuda-b256-llama3", marks=pytest.mark.gpu),
    pytest.param("cuda", 7, 49152, BF16, id="cuda-bf16-smollm2", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device,rows,vocab,dtype", CASES)
def test_argmax_rows_equals_torch(device: str, rows: int, vocab: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, vocab, device=device).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_argmax_rows_ties_nan_inf_and_strides(device: str) -> None:
    vocab = 9000 if device == "cpu" else 128256
    x = torch.randn(6, vocab, device=device)
    x[0] = 1.0                                   # all tied: index 0
    x[1, 7000] = x[1, 8100] = 50.0               # tie across chunks: the left one
    x[1, 100] = 49.0
    x[2, 5000] = float("nan")                    # NaN wins, even against +inf before it
    x[2, 3] = float("inf")
    x[3] = float("-inf")                         # all -inf: index 0
    x[4, -1] = 1e30                              # the last entry
    x[5, 4096] = float("nan")                    # two NaNs: the first
    x[5, 8000] = float("nan")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [0, 7000, 5000, 0,
                                                                     vocab - 1, 4096]
    wide = torch.randn(4, vocab + 64, device=device)
    view = wide[:, 32:32 + vocab]                # a row stride larger than the row
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_argmax_rows_refuses_bad_input() -> None:
    assert argmax_rows(torch.zeros(0, 5)).shape == (0,)
    with pytest.raises(ValueError, match="empty"):
        argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="dimensions"):
        argmax_rows(torch.zeros(5))
    with pytest.raises(ValueError, match="contiguous"):
        argmax_rows(torch.zeros(5, 4).t())

"""kernels.decode_attention against torch_ops.paged_attention_decode, both ways of merging the
splits (a second launch, or the last split's program through an atomic ticket)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import decode_attention, torch_ops
from kernels.decode_attention import DecodeConfig, DecodeWorkspace, paged_attention_decode

F32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = F32
    num_splits: int | None = None  # None: the launcher's heuristic
    block_n: int = 16
    num_warps: int = 4  # also sizes the fused merge's chunks of splits (fewer warps: smaller)


def _cpu(case: Case, name: str):
    return pytest.param("cpu", case, id=f"cpu-{name}")


def _gpu(case: Case, name: str):
    return pytest.param("cuda", case, id=f"cuda-{name}", marks=pytest.mark.gpu)


CASES = [
    _cpu(Case((1, 7, 30, 13), 8, 2, 32, 4, num_splits=3), "gqa4-ragged-splits3"),
    _cpu(Case((5, 16, 1), 2, 2, 32, 4, num_splits=1), "gqa1-one-split"),
    _cpu(Case((40, 9), 6, 2, 64, 8), "gqa3-default-splits"),
    _cpu(Case((1, 1), 4, 1, 16, 4, num_splits=4), "context1-empty-splits"),
    _cpu(Case((0, 7, 0, 30), 8, 2, 32, 4, num_splits=3), "padding-rows"),
    _cpu(Case((30, 5, 17), 4, 2, 32, 8, num_splits=8), "splits-exceed-tiles"),
    # The fused merge takes 4 splits of 4 heads x 64 at a time with one warp: three steps.
    _cpu(Case((90, 40, 3), 8, 2, 64, 4, num_splits=12, block_n=8, num_warps=1),
         "gqa4-merge-in-chunks"),
    # The merge kernel takes 64 splits of one head x 64 at a time: two steps (fused: 3).
    _cpu(Case((30, 2), 2, 1, 64, 4, num_splits=80), "gqa2-merge-in-chunks"),
    _gpu(Case((4096, 1, 17, 2500, 1000, 4095, 33, 3000), 32, 8, 128, 16, BF16, block_n=64),
         "llama8b-bf16-default"),
    _gpu(Case((4096, 1, 17, 2500), 32, 8, 128, 16, BF16, num_splits=1, block_n=64),
         "llama8b-bf16-one-split"),
    _gpu(Case((2048, 3, 700), 32, 8, 128, 16, F32, num_splits=7, block_n=32), "llama8b-f32"),
    _gpu(Case((1500, 64, 1), 9, 3, 64, 16, BF16, block_n=64), "smollm-gqa3-bf16"),
    _gpu(Case((333, 1024), 8, 8, 128, 16, BF16, num_splits=5, block_n=64), "gqa1-bf16"),
    _gpu(Case((16000,), 32, 8, 128, 16, BF16, block_n=64), "llama8b-bf16-batch1-long"),
    _gpu(Case((576,), 32, 8, 128, 16, BF16, block_n=32), "llama8b-bf16-batch1-tiles32"),
    _gpu(Case((640,) * 7 + (1, 0, 2000), 32, 8, 128, 16, BF16, num_splits=1, block_n=64),
         "llama8b-bf16-batch10-one-split"),
    _gpu(Case((16000, 5, 0), 32, 8, 128, 16, BF16, num_splits=128, block_n=64),
         "llama8b-bf16-128-splits"),
]


MERGES = [pytest.param(False, id="two-launch"), pytest.param(True, id="fused")]


def _reference(q, k_cache, v_cache, tables, seq_lens, scale):
    return torch_ops.paged_attention_decode(q.float(), k_cache.float(), v_cache.float(),
                                            tables, seq_lens, scale)


def _check(out, q, k_cache, v_cache, tables, seq_lens, scale, tol, check_rel) -> None:
    """Rows with context match the reference; rows of length 0 (padding) are zeros."""
    pad = seq_lens == 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    keep = (~pad).nonzero().squeeze(1)
    check_rel(out[keep].float(), _reference(q[keep], k_cache, v_cache, tables[keep],
                                            seq_lens[keep], scale), tol)


@pytest.mark.parametrize("fused", MERGES)
@pytest.mark.parametrize("device,case", CASES)
def test_matches_reference(device: str, case: Case, fused: bool, make_paged, check_rel) -> None:
    k_cache, v_cache, tables = make_paged(list(case.seq_lens), case.block_size, case.kv_heads,
                                          case.head_dim, case.dtype, device)
    b = len(case.seq_lens)
    q = torch.randn(b, case.heads, case.head_dim, device=device).to(case.dtype)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    scale = case.head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    config = DecodeConfig(block_n=case.block_n, num_warps=case.num_warps, fused_merge=fused)
    got = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, scale, out=out,
                                 num_splits=case.num_splits, config=config)
    assert got is out
    tol = 1e-5 if case.dtype == F32 else 1e-2
    _check(out, q, k_cache, v_cache, tables, seq_lens, scale, tol, check_rel)


@pytest.mark.parametrize("fused", MERGES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_preallocated_workspace_and_padding_rows(device: str, fused: bool, make_paged,
                                                 check_rel) -> None:
    """The CUDA-graph way: a poisoned workspace for a larger batch, fixed splits; a row with
    seq_len 0 (batch padding) comes out as zeros."""
    lens = [13, 0, 6]
    k_cache, v_cache, tables = make_paged(lens, 4, 2, 32, F32, device)
    q = torch.randn(3, 4, 32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ws = DecodeWorkspace.allocate(8, 4, 32, 3, device)
    for t in (ws.acc, ws.max, ws.sum):
        t.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, 0.2, out=out, workspace=ws,
                           config=DecodeConfig(block_n=16, fused_merge=fused))
    _check(out, q, k_cache, v_cache, tables, seq_lens, 0.2, 1e-5, check_rel)
    assert not ws.tickets.any()


@pytest.mark.parametrize("fused", MERGES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_back_to_back_calls_share_one_workspace(device: str, fused: bool, make_paged,
                                                check_rel) -> None:
    """What layers and graph replays do: launch after launch on one workspace, here with other
    inputs, batch sizes and split counts (up to its capacity). The fused merge's tickets are
    back to zero after every launch, so each result is right."""
    lens = [21, 3, 0, 40]
    k_cache, v_cache, tables = make_paged(lens, 4, 2, 32, F32, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ws = DecodeWorkspace.allocate(4, 8, 32, 5, device)
    config = DecodeConfig(block_n=16, fused_merge=fused)
    for rows, splits in ((4, 5), (4, 5), (3, 2), (4, 4)):
        q = torch.randn(rows, 8, 32, device=device)
        out = torch.full_like(q, float("nan"))
        paged_attention_decode(q, k_cache, v_cache, tables[:rows], seq_lens[:rows], 0.3, out=out,
                               num_splits=splits, workspace=ws, config=config)
        _check(out, q, k_cache, v_cache, tables[:rows], seq_lens[:rows], 0.3, 1e-5, check_rel)
        assert not ws.tickets.any()


def test_rejects_bad_arguments() -> None:
    q = torch.randn(2, 4, 32)
    k = torch.randn(5, 4, 2, 32)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables: dtype"):
        paged_attention_decode(q, k, k, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention_decode(torch.randn(2, 3, 32), k, k, tables, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens: expected shape"):
        paged_attention_decode(q, k, k, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="k_cache: the last dimension must be contiguous"):
        kt = torch.randn(5, 4, 2, 64)[..., ::2]
        paged_attention_decode(q, kt, kt, tables, lens, 1.0)
    with pytest.raises(ValueError, match="workspace"):  # more splits than it holds
        paged_attention_decode(q, k, k, tables, lens, 1.0, num_splits=4,
                               workspace=DecodeWorkspace.allocate(2, 4, 32, 3, "cpu"))
    with pytest.raises(ValueError, match="workspace"):  # other head count
        paged_attention_decode(q, k, k, tables, lens, 1.0, num_splits=2,
                               workspace=DecodeWorkspace.allocate(2, 8, 32, 3, "cpu"))


def test_config_for_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """By the programs batch x kv heads make, on an H200's 132 multiprocessors: 32-token tiles
    up to half of them, 64 above (fp8: 128, read as 16-bit pairs, the table a tile ahead with
    one split, else 128 registers on 128-token tiles); the fused merge above an eighth; the
    rest the defaults."""
    monkeypatch.setattr(decode_attention, "_processor_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert DecodeConfig.for_batch(1, 8, cpu) == DecodeConfig(block_n=32)
    assert DecodeConfig.for_batch(2, 8, cpu) == DecodeConfig(block_n=32)
    assert DecodeConfig.for_batch(4, 8, cpu) == DecodeConfig(block_n=32, fused_merge=True)
    assert DecodeConfig.for_batch(8, 8, cpu) == DecodeConfig(block_n=32, fused_merge=True)
    assert DecodeConfig.for_batch(16, 8, cpu) == DecodeConfig(fused_merge=True)
    assert DecodeConfig.for_batch(256, 8, cpu) == DecodeConfig(fused_merge=True)
    # an fp8 pool: 128-token tiles where bf16 takes 64; V widened before shared memory above
    # two programs a multiprocessor
    assert DecodeConfig.for_batch(32, 8, cpu, fp8=True) == DecodeConfig(
        block_n=128, fused_merge=True, widen_v_first=False, fp8_pairs=True, max_registers=128)
    assert DecodeConfig.for_batch(64, 8, cpu, fp8=True) == DecodeConfig(
        block_n=128, fused_merge=True, widen_v_first=True, fp8_pairs=True, max_registers=128)
    assert DecodeConfig.for_batch(8, 8, cpu, fp8=True) == DecodeConfig(
        block_n=32, fused_merge=True, widen_v_first=False, fp8_pairs=True)
    # one split from 4 programs a multiprocessor up (default_num_splits): the table a tile ahead
    assert DecodeConfig.for_batch(66, 8, cpu, fp8=True) == DecodeConfig(
        block_n=128, fused_merge=True, widen_v_first=True, fp8_pairs=True, prefetch_table=True)
    assert decode_attention.default_num_splits(66, 8, 4096, cpu, DecodeConfig()) == 1
    assert decode_attention.default_num_splits(65, 8, 4096, cpu, DecodeConfig()) == 2

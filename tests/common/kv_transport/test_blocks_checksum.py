from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.kv_transport import checksum as checksum_module
from common.kv_transport.blocks import block_runs, copy_blocks, dtype_from_name, dtype_name
from common.kv_transport.checksum import block_sums_torch, kv_checksum

SHAPE = [2, 2, 6, 4, 2, 8]  # layers, kv, blocks, block_size, kv_heads, head_dim


def _pool(seed: int, dtype: torch.dtype = torch.float32, shape: list[int] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference_checksum(pool: torch.Tensor, block_ids: list[int]) -> int:
    """The documented formula with Python integers."""
    mix = 0x9E3779B97F4A7C15
    total = 0
    for j, b in enumerate(block_ids):
        raw = pool[:, :, b].contiguous().view(torch.uint8).numpy().tobytes()
        words = [int.from_bytes(raw[i:i + 4], "little", signed=True)
                 for i in range(0, len(raw), 4)]
        total += (j + 1) * (sum(words) + mix * sum(w * w for w in words))
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


def test_block_runs() -> None:
    assert block_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    assert block_runs([0, 1, 2], [5, 6, 7]) == [(0, 5, 3)]
    assert block_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1, 2], [3])


def test_copy_blocks_exact() -> None:
    src = _pool(1)
    dst = torch.zeros(SHAPE[:2] + [9] + SHAPE[3:])
    copy_blocks(src, [5, 0, 1, 2], dst, [8, 3, 4, 0])
    for s, d in [(5, 8), (0, 3), (1, 4), (2, 0)]:
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert torch.count_nonzero(dst[:, :, [1, 2, 5, 6, 7]]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checksum_matches_the_documented_formula(dtype: torch.dtype) -> None:
    pool = _pool(2, dtype)
    for ids in ([0], [3, 1, 4], [5, 4, 3, 2, 1, 0]):
        assert kv_checksum(pool, ids) == _reference_checksum(pool, ids)


def test_checksum_catches_order_swaps_and_bit_flips() -> None:
    pool = _pool(3)
    base = kv_checksum(pool, [1, 2, 3])
    assert kv_checksum(pool.clone(), [1, 2, 3]) == base
    assert kv_checksum(pool, [2, 1, 3]) != base
    assert kv_checksum(pool, [1, 2, 2]) != base
    flipped = pool.clone()
    flipped.view(torch.int32)[1, 0, 2, 3, 1, 5] ^= 1 << 7
    assert kv_checksum(flipped, [1, 2, 3]) != base
    # Moving a value between two words of one block keeps its plain sum; the squares differ.
    words = pool.clone().view(torch.int32)
    words[0, 0, 1, 0, 0, 0] += 1000
    words[0, 0, 1, 0, 0, 1] -= 1000
    assert kv_checksum(words.view(torch.float32), [1, 2, 3]) != base


def test_checksum_in_several_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(4)
    ids = [5, 0, 3, 1, 2]
    want = kv_checksum(pool, ids)
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    monkeypatch.setattr(checksum_module, "_CHUNK_BYTES", 2 * block_bytes)  # 2 blocks a pass
    assert kv_checksum(pool, ids) == want == _reference_checksum(pool, ids)


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("float16") is torch.float16
    with pytest.raises(ValueError):
        dtype_from_name("nn")


def test_combine_wraps_like_int64() -> None:
    """combine() on the host gives what the same formula gives in wrapping int64 tensors."""
    lo, hi = -(1 << 63), (1 << 63) - 1
    sums = torch.tensor([[hi, hi], [lo, 7], [-1, lo], [12345, -987654321], [hi, lo]])
    weight = torch.arange(1, len(sums) + 1, dtype=torch.int64)
    want = int((weight * (sums[:, 0] + checksum_module._MIX * sums[:, 1])).sum())
    assert checksum_module.combine(sums.tolist()) == want
    assert checksum_module.combine([]) == 0


def _sums_and_scratch(pool: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    sums = block_sums_torch(pool, ids)
    buffers = checksum_module._scratch_local.buffers[(pool.device, pool.dtype)]
    return sums, [t.data_ptr() for t in buffers]


def test_torch_sums_reuse_this_threads_scratch() -> None:
    """The CPU path gathers into the same buffers call after call (no fresh pages to fault in),
    and another thread gets buffers of its own."""
    pool = _pool(4)
    ids = torch.tensor([3, 1, 2])
    first, held = _sums_and_scratch(pool, ids)
    again, held_again = _sums_and_scratch(pool, ids)
    assert torch.equal(again, first) and held_again == held
    with ThreadPoolExecutor(1) as other:
        theirs, their_buffers = other.submit(_sums_and_scratch, pool, ids).result()
    assert torch.equal(theirs, first) and set(their_buffers).isdisjoint(held)

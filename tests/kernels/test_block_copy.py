"""kernels.block_copy against torch_ops.copy_blocks (exact)."""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ops
from kernels.block_copy import copy_blocks, copy_listed_blocks

BF16 = torch.bfloat16

# pool shape [layers, 2, num_blocks, block_size, kv_heads, head_dim], blocks copied, dtype
POOLS = [
    pytest.param("cpu", (2, 2, 9, 4, 2, 16), 4, torch.float32, id="cpu-pool"),
    pytest.param("cpu", (1, 2, 6, 3, 3, 20), 2, torch.float32, id="cpu-odd-inner"),
    pytest.param("cuda", (32, 2, 300, 16, 8, 128), 100, BF16, id="cuda-llama8b",
                 marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device,shape,n,dtype", POOLS)
def test_between_pools(device: str, shape: tuple, n: int, dtype: torch.dtype) -> None:
    src = torch.randn(shape, device=device).to(dtype)
    dst_shape = (*shape[:2], shape[2] + 5, *shape[3:])
    dst = torch.randn(dst_shape, device=device).to(dtype)
    src_ids = torch.randperm(shape[2], device=device)[:n]
    dst_ids = torch.randperm(dst_shape[2], device=device)[:n]
    want = dst.clone()
    torch_ops.copy_blocks(src, want, src_ids, dst_ids)
    copy_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("device,shape,n,dtype", POOLS)
def test_copy_on_write_within_one_pool(device: str, shape: tuple, n: int,
                                       dtype: torch.dtype) -> None:
    pool = torch.randn(shape, device=device).to(dtype)
    ids = torch.randperm(shape[2], device=device)
    src_ids, dst_ids = ids[:n], ids[n:2 * n]
    want = pool.clone()
    torch_ops.copy_blocks(want.clone(), want, src_ids, dst_ids)
    copy_blocks(pool, pool, src_ids, dst_ids)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_layer_cache_block_dim_0(device: str) -> None:
    src = torch.randn(7, 4, 2, 16, device=device).to(BF16 if device == "cuda" else torch.float32)
    dst = torch.randn_like(src.float()).to(src.dtype)
    ids = torch.tensor([6, 0, 3], device=device)
    want = dst.clone()
    torch_ops.copy_blocks(src, want, ids, ids.flip(0), block_dim=0)
    copy_blocks(src, dst, ids, ids.flip(0), block_dim=0)
    assert torch.equal(dst, want)


def test_rejects_bad_arguments() -> None:
    pool = torch.randn(2, 2, 5, 4, 2, 16)
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="each block must be contiguous"):
        copy_blocks(pool[..., :8], pool.clone()[..., :8], ids, ids)
    with pytest.raises(ValueError, match="differ outside the block dimension"):
        copy_blocks(pool, torch.randn(2, 2, 5, 4, 1, 16), ids, ids)
    with pytest.raises(ValueError, match="dst: dtype"):
        copy_blocks(pool, pool.double(), ids, ids)
    with pytest.raises(ValueError, match="src_ids: dtype"):
        copy_blocks(pool, pool.clone(), ids.int(), ids)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_listed_ids_from_the_host(device: str) -> None:
    """The host-list entry point: the same copy, and ids out of range refused before launch."""
    src = torch.randn(2, 2, 9, 4, 2, 16, device=device)
    dst = torch.randn(2, 2, 6, 4, 2, 16, device=device)
    want = dst.clone()
    torch_ops.copy_blocks(src, want, torch.tensor([8, 0, 3], device=device),
                          torch.tensor([1, 5, 2], device=device), block_dim=2)
    copy_listed_blocks(src, dst, [8, 0, 3], [1, 5, 2], block_dim=2)
    assert torch.equal(dst, want)
    with pytest.raises(IndexError, match="dst_ids"):
        copy_listed_blocks(src, dst, [0], [6], block_dim=2)
    with pytest.raises(IndexError, match="src_ids"):
        copy_listed_blocks(src, dst, [-1], [0], block_dim=2)
    with pytest.raises(ValueError, match="source blocks"):
        copy_listed_blocks(src, dst, [0, 1], [0], block_dim=2)

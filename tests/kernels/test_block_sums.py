"""kernels.block_sums against the checksum's torch path: equal bit for bit (integer sums)."""

from __future__ import annotations

import pytest
import torch

from common.kv_transport.checksum import block_sums_torch, kv_checksum
from kernels import block_sums_cpu
from kernels.block_sums import block_sums, copy_block_sums, prepare_copy_block_sums

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sums_equal_torch(device: str, dtype: torch.dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("CUDA present: Triton compiles for it, the interpreter is off")
    torch.manual_seed(0)
    # [layers, 2, blocks, block_size, kv_heads, head_dim]; large values exercise the wrapping.
    pool = (torch.randn(3, 2, 9, 4, 2, 16) * 1e30).to(dtype).to(device)
    ids = torch.tensor([5, 0, 8, 5, 2], dtype=torch.int64, device=device)
    got = block_sums(pool, ids)
    assert torch.equal(got.cpu(), block_sums_torch(pool.cpu(), ids.cpu()))
    assert block_sums(pool, ids[:0]).shape == (0, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_copy_block_sums_copies_and_sums_what_it_copied(device: str, dtype: torch.dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("CUDA present: Triton compiles for it, the interpreter is off")
    torch.manual_seed(1)
    src = (torch.randn(3, 2, 9, 4, 2, 16) * 1e3).to(dtype).to(device)
    dst = torch.zeros(3, 2, 12, 4, 2, 16, dtype=dtype, device=device)
    src_ids, dst_ids = [5, 0, 8, 2], [11, 3, 4, 0]
    ids = torch.tensor([src_ids, dst_ids], dtype=torch.int64, device=device)
    got = copy_block_sums(src, dst, ids)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d].view(torch.uint8), src[:, :, s].view(torch.uint8))
    untouched = [b for b in range(12) if b not in dst_ids]
    assert not dst[:, :, untouched].view(torch.uint8).any()
    assert torch.equal(got.cpu(), block_sums_torch(src.cpu(), ids[0].cpu()))
    assert torch.equal(got.cpu(), block_sums_torch(dst.cpu(), ids[1].cpu()))
    out = torch.zeros(4, 2, dtype=torch.int64, device=device)  # sums allocated ahead
    launch = prepare_copy_block_sums(src, dst, ids, out)  # checked now, launched later
    assert not out.any()
    assert launch() is out and torch.equal(out, got)
    with pytest.raises(ValueError, match="out must be"):
        prepare_copy_block_sums(src, dst, ids, out[:3])


def test_block_sums_refuses_odd_pools():
    with pytest.raises(ValueError, match="contiguous"):
        block_sums(torch.zeros(2, 2, 3, 4, 2, 16).transpose(0, 1), torch.tensor([0]))
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        block_sums(torch.zeros(2, 2, 3, 4, 2, 3, dtype=torch.bfloat16), torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checksum_same_on_gpu_and_cpu():
    pool = torch.randn(4, 2, 20, 16, 8, 128, dtype=torch.bfloat16)
    ids = [3, 17, 0, 9]
    assert kv_checksum(pool.cuda(), ids) == kv_checksum(pool, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_kernel_equals_torch(dtype: torch.dtype):
    """kernels.block_sums_cpu (the CPU checksum's path) against the torch ops, bit for bit,
    including sums that wrap and blocks listed twice."""
    assert block_sums_cpu.available()
    torch.manual_seed(2)
    pool = (torch.randn(3, 2, 9, 4, 2, 16) * 1e30).to(dtype)
    ids = torch.tensor([5, 0, 8, 5, 2], dtype=torch.int64)
    assert torch.equal(block_sums_cpu.block_sums(pool, ids), block_sums_torch(pool, ids))
    assert torch.equal(block_sums_cpu.reference(pool, ids), block_sums_torch(pool, ids))
    assert block_sums_cpu.block_sums(pool, ids[:0]).shape == (0, 2)
    assert block_sums_cpu.serves(pool) and not block_sums_cpu.serves(pool.transpose(0, 1))
    with pytest.raises(RuntimeError, match="outside the pool"):
        block_sums_cpu.block_sums(pool, torch.tensor([9]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_copy_block_sums_copies_and_sums_what_it_copied(dtype: torch.dtype):
    torch.manual_seed(3)
    src = (torch.randn(3, 2, 9, 4, 2, 16) * 1e3).to(dtype)
    dst = torch.zeros(3, 2, 12, 4, 2, 16, dtype=dtype)
    src_ids, dst_ids = [5, 0, 8, 2], [11, 3, 4, 0]
    got = block_sums_cpu.copy_block_sums(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids))
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d].view(torch.uint8), src[:, :, s].view(torch.uint8))
    untouched = [b for b in range(12) if b not in dst_ids]
    assert not dst[:, :, untouched].view(torch.uint8).any()
    assert torch.equal(got, block_sums_torch(src, torch.tensor(src_ids)))
    with pytest.raises(RuntimeError, match="destination block id 12"):
        block_sums_cpu.copy_block_sums(src, dst, torch.tensor([0]), torch.tensor([12]))
    with pytest.raises(RuntimeError, match="differ outside the block axis"):
        block_sums_cpu.copy_block_sums(src, torch.zeros(3, 2, 12, 4, 2, 8, dtype=dtype),
                                       torch.tensor([0]), torch.tensor([1]))

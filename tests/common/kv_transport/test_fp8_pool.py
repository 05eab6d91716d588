"""An fp8 KV pool (--kv-cache-dtype fp8) through the handoff: the descriptor names its dtype and
scale, its blocks checksum and copy bit for bit, and a receiver whose pool has another dtype or
scale refuses the handoff by name before copying anything."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from common.engine.model_runner import gather_blocks, scatter_blocks
from common.errors import TransferError
from common.kv_transport.checksum import kv_checksum
from common.kv_transport.select import KVReceiver
from common.kv_transport.source import KVSource
from common.registry import HandoffDescriptor
from kernels.torch_ops import to_fp8

SHAPE = [3, 2, 10, 4, 2, 8]  # layers, kv, blocks, block_size, kv_heads, head_dim
FP8 = torch.float8_e4m3fn


@pytest.fixture
def source() -> Iterator[KVSource]:
    pool = to_fp8(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * 50)
    src = KVSource("prefill-0", pool, "test-model", address="10.1.1.1:7000")
    yield src
    src.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_descriptor_records_dtype_and_scale(source: KVSource) -> None:
    desc = source.describe("r1", [7, 2, 3], num_tokens=10, block_hashes=[])
    assert (desc.dtype, desc.kv_scale) == ("float8_e4m3fn", 1.0)
    assert HandoffDescriptor.from_json(desc.to_json()) == desc
    # The checksum reads the pool's bytes: any changed byte of a listed block changes it.
    before = kv_checksum(source.pool, [7, 2, 3])
    assert desc.checksum == before
    raw = source.pool.view(torch.uint8)
    raw[1, 0, 2, 3, 1, 5] ^= 1
    assert kv_checksum(source.pool, [7, 2, 3]) != before
    raw[1, 0, 2, 3, 1, 5] ^= 1


def test_fp8_blocks_pull_exactly(source: KVSource) -> None:
    desc = source.describe("r1", [7, 2, 3], num_tokens=10, block_hashes=[])
    dst = torch.zeros([3, 2, 6, 4, 2, 8], dtype=FP8)
    receiver = KVReceiver()
    assert receiver.pull(desc, dst, [0, 5, 1]) == "local"
    for s, d in [(7, 0), (2, 5), (3, 1)]:
        assert torch.equal(_bytes(dst[:, :, d]), _bytes(source.pool[:, :, s]))
    assert not _bytes(dst[:, :, [2, 3, 4]]).any()
    receiver.close()


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_other_kv_dtype_refuses_the_handoff(source: KVSource, dst_dtype: torch.dtype) -> None:
    desc = source.describe("r1", [7, 2], num_tokens=8, block_hashes=[])
    dst = torch.zeros([3, 2, 6, 4, 2, 8], dtype=dst_dtype)
    receiver = KVReceiver()
    with pytest.raises(TransferError, match=r"KV cache dtype mismatch: the source pool holds "
                       r"float8_e4m3fn \(scale 1.0\), this one "
                       + str(dst_dtype).removeprefix("torch.")
                       + r" .*same --kv-cache-dtype"):
        receiver.pull(desc, dst, [0, 1])
    assert not dst.any()  # refused before any copy
    # ... and the other way round: a bf16/fp32 prefill side, an fp8 decode side.
    plain = KVSource("prefill-1", torch.ones(SHAPE, dtype=dst_dtype), "test-model")
    fp8_dst = torch.zeros([3, 2, 6, 4, 2, 8], dtype=FP8)
    with pytest.raises(TransferError, match="KV cache dtype mismatch"):
        receiver.pull(plain.describe("r2", [1], num_tokens=4, block_hashes=[]), fp8_dst, [0])
    plain.close()
    receiver.close()


def test_other_scale_refuses_the_handoff(source: KVSource) -> None:
    desc = dataclasses.replace(source.describe("r1", [7], num_tokens=4, block_hashes=[]),
                               kv_scale=0.5)
    with pytest.raises(TransferError, match=r"scale 0.5\), this one float8_e4m3fn \(scale 1.0"):
        KVReceiver().pull(desc, torch.zeros([3, 2, 6, 4, 2, 8], dtype=FP8), [0])


def test_export_import_fp8_blocks(source: KVSource) -> None:
    """The model runner's export_kv / import_kv (the CPU path has no fp8 index_copy_)."""
    kv = gather_blocks(source.pool, [4, 1], use_kernel=False)
    assert kv.dtype == FP8 and kv.shape == (3, 2, 2, 4, 2, 8)
    dst = torch.zeros([3, 2, 6, 4, 2, 8], dtype=FP8)
    scatter_blocks(dst, [5, 0], kv, use_kernel=False)
    assert torch.equal(_bytes(dst[:, :, 5]), _bytes(source.pool[:, :, 4]))
    assert torch.equal(_bytes(dst[:, :, 0]), _bytes(source.pool[:, :, 1]))
    assert not _bytes(dst[:, :, 1:5]).any()

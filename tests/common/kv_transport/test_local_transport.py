from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from common.errors import TransferError
from common.kv_transport.blocks import KV_LAYOUT
from common.kv_transport.checksum import kv_checksum
from common.kv_transport.locality import host_id
from common.kv_transport.select import KVReceiver, make_transport
from common.kv_transport.source import KVSource

SHAPE = [3, 2, 10, 4, 2, 8]  # layers, kv, blocks, block_size, kv_heads, head_dim


@pytest.fixture
def source() -> Iterator[KVSource]:
    pool = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    src = KVSource("prefill-0", pool, "test-model", address="10.1.1.1:7000")
    yield src
    src.close()


def _dst(num_blocks: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros([3, 2, num_blocks, 4, 2, 8], dtype=dtype)


def test_descriptor_describes_the_pool(source: KVSource) -> None:
    desc = source.describe("r1", [7, 2, 3], num_tokens=10, block_hashes=[111, 222])
    assert (desc.request_id, desc.source_instance, desc.source_address) == (
        "r1", "prefill-0", "10.1.1.1:7000")
    assert (desc.dtype, desc.block_size, desc.layout) == ("float32", 4, KV_LAYOUT)
    assert (desc.num_layers, desc.num_kv_heads, desc.head_dim) == (3, 2, 8)
    assert (desc.num_tokens, desc.block_ids, desc.block_hashes) == (10, [7, 2, 3], [111, 222])
    assert desc.source_host_id == host_id()
    assert desc.checksum == kv_checksum(source.pool, [7, 2, 3])
    assert sorted(desc.transports) == ["grpc", "local"]
    assert desc.transports["grpc"] == {"address": "10.1.1.1:7000"}


def test_local_pull_copies_exactly(source: KVSource) -> None:
    desc = source.describe("r1", [7, 2, 3], num_tokens=10, block_hashes=[])
    dst = _dst()
    receiver = KVReceiver()
    assert receiver.pull(desc, dst, [0, 5, 1]) == "local"
    for s, d in [(7, 0), (2, 5), (3, 1)]:
        assert torch.equal(dst[:, :, d], source.pool[:, :, s])
    assert torch.count_nonzero(dst[:, :, [2, 3, 4]]) == 0
    receiver.close()


def test_export_kv(source: KVSource) -> None:
    kv = source.export_kv([4, 1])
    assert kv.shape == (3, 2, 2, 4, 2, 8)
    assert torch.equal(kv[:, :, 0], source.pool[:, :, 4])
    assert torch.equal(kv[:, :, 1], source.pool[:, :, 1])
    with pytest.raises(ValueError):
        source.export_kv([10])


def test_blocks_reused_after_publish_fail_the_checksum(source: KVSource) -> None:
    desc = source.describe("r1", [7, 2], num_tokens=8, block_hashes=[])
    source.pool[1, 1, 2, 3] += 0.5   # the source wrote over block 2 (it released it too early)
    with pytest.raises(TransferError, match="checksum mismatch"):
        make_transport("local").pull(desc, _dst(), [0, 1])


def test_incompatible_destinations_are_refused(source: KVSource) -> None:
    desc = source.describe("r1", [7, 2], num_tokens=8, block_hashes=[])
    transport = make_transport("local")
    with pytest.raises(TransferError, match="dtype"):
        transport.pull(desc, _dst(dtype=torch.bfloat16), [0, 1])
    with pytest.raises(TransferError, match="do not fit"):
        transport.pull(desc, torch.zeros([3, 2, 6, 4, 2, 16]), [0, 1])
    with pytest.raises(TransferError, match="destination blocks"):
        transport.pull(desc, _dst(), [0])
    with pytest.raises(TransferError, match="outside"):
        transport.pull(desc, _dst(), [0, 6])
    with pytest.raises(TransferError, match="outside"):
        transport.pull(dataclasses.replace(desc, block_ids=[7, 10]), _dst(), [0, 1])
    with pytest.raises(TransferError, match="layout"):
        transport.pull(dataclasses.replace(desc, layout="blocks,layers"), _dst(), [0, 1])


def test_withdrawn_pool_is_an_error(source: KVSource) -> None:
    desc = source.describe("r1", [7], num_tokens=4, block_hashes=[])
    source.close()
    with pytest.raises(TransferError, match="no pool shared"):
        make_transport("local").pull(desc, _dst(), [0])


def test_unknown_transport_name() -> None:
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_transport("rdma")

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from common.errors import TransferError
from common.kv_transport.select import KVReceiver, make_transport
from common.kv_transport.shm import SharedMemoryPool

SHAPE = [2, 2, 12, 4, 2, 8]  # layers, kv, blocks, block_size, kv_heads, head_dim


def _seeded_pool(seed: int, shape: list[int]) -> torch.Tensor:
    """The data pool_owner.py fills its pool with."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_shared_memory_pool_file(tmp_path: Path) -> None:
    shm = SharedMemoryPool(directory=tmp_path)
    pool = shm([2, 2, 3, 4, 2, 8], torch.bfloat16, "cpu")
    assert pool.shape == (2, 2, 3, 4, 2, 8) and pool.dtype == torch.bfloat16
    assert torch.count_nonzero(pool) == 0
    path = shm.path
    assert path is not None and path.parent == tmp_path
    assert path.stat().st_size == 2 * 2 * 3 * 4 * 2 * 8 * 2
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert shm.describe() == {"path": str(path), "shape": [2, 2, 3, 4, 2, 8], "dtype": "bfloat16"}
    pool[1, 0, 2] = 3.0  # writes go to the file
    mapped = torch.from_file(str(path), shared=False, size=pool.numel(), dtype=torch.bfloat16)
    assert torch.equal(mapped.view(pool.shape), pool)
    with pytest.raises(RuntimeError):
        shm([1], torch.float32, "cpu")
    shm.close()
    assert not path.exists()
    assert float(pool[1, 0, 2].max()) == 3.0  # still usable after the file is removed
    with pytest.raises(ValueError):
        SharedMemoryPool(directory=tmp_path)([1], torch.float32, "cuda")


def test_pull_from_another_process(pool_owner) -> None:
    owner = pool_owner("shm", 7, SHAPE, [3, 4, 9, 0])
    desc = owner.desc
    assert sorted(desc.transports) == ["local", "shm"]
    path = desc.transports["shm"]["path"]
    assert path.startswith("/dev/shm/") and os.path.exists(path)

    dst = torch.zeros([2, 2, 8, 4, 2, 8])
    receiver = KVReceiver()
    assert receiver.pull(desc, dst, [6, 1, 2, 7]) == "shm"  # same host, other process
    want = _seeded_pool(7, SHAPE)
    for s, d in [(3, 6), (4, 1), (9, 2), (0, 7)]:
        assert torch.equal(dst[:, :, d], want[:, :, s])
    assert torch.count_nonzero(dst[:, :, [0, 3, 4, 5]]) == 0

    # The source overwrote a block it should have kept pinned: caught by the checksum.
    assert owner.command("scribble 9") == "ok"
    with pytest.raises(TransferError, match="checksum mismatch"):
        receiver.pull(desc, dst, [6, 1, 2, 7])
    assert owner.exit() == 0
    assert not os.path.exists(path)  # the owner removed its pool file
    receiver.close()


def test_missing_pool_file_is_a_transfer_error(pool_owner) -> None:
    owner = pool_owner("shm", 1, SHAPE, [1])
    assert owner.exit() == 0
    with pytest.raises(TransferError, match="cannot map"):
        make_transport("shm").pull(owner.desc, torch.zeros([2, 2, 2, 4, 2, 8]), [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pull_from_cpu_source_into_gpu_pool(pool_owner) -> None:
    owner = pool_owner("shm", 8, SHAPE, [2, 3, 11])
    dst = torch.zeros([2, 2, 4, 4, 2, 8], device="cuda")
    receiver = KVReceiver()
    assert receiver.pull(owner.desc, dst, [3, 0, 1]) == "shm"
    want = _seeded_pool(8, SHAPE)
    for s, d in [(2, 3), (3, 0), (11, 1)]:
        assert torch.equal(dst[:, :, d].cpu(), want[:, :, s])
    receiver.close()
    assert owner.exit() == 0

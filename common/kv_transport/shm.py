"""shm: source and receiver on one host, CPU pools. The source engine's pool itself lives in a
file under /dev/shm; a receiver maps that file read-only (once per source) and copies the listed
blocks straight into its own pool: one copy, no staging.

The file is created with mode 0600 (receivers run as the same user) and removed by close(), at
exit, or by whoever cleans /dev/shm after a crash; a receiver's mapping stays valid after removal.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.errors import TransferError
from common.kv_transport.base import KVTransport, check_source
from common.kv_transport.blocks import copy_blocks, dtype_from_name, dtype_name
from common.kv_transport.checksum import combine
from common.registry.records import HandoffDescriptor
from kernels import block_sums_cpu


class SharedMemoryPool:
    """A kv_cache_allocator(shape, dtype, device) -> Tensor whose pool is a shared file.

    One pool per object. The memory is reserved when the pool is made (posix_fallocate), so a
    /dev/shm too small for it fails here with OSError rather than with SIGBUS later.
    """

    def __init__(self, directory: str | os.PathLike = "/dev/shm", prefix: str = "splitserve-kv"):
        self.directory = Path(directory)
        self.prefix = prefix
        self.path: Path | None = None
        self.tensor: torch.Tensor | None = None

    def __call__(self, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError(f"a shared-memory pool lives on the CPU, not {device}")
        if self.tensor is not None:
            raise RuntimeError(f"{self.path} already holds a pool")
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        path = self.directory / f"{self.prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}.kv"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            path.unlink()
            raise
        os.close(fd)
        self.path = path
        atexit.register(self.close)
        self.tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(*shape)
        return self.tensor

    def describe(self) -> dict[str, Any]:
        """The descriptor's "shm" entry."""
        if self.tensor is None or self.path is None:
            raise RuntimeError("no pool allocated yet")
        return {"path": str(self.path), "shape": list(self.tensor.shape),
                "dtype": dtype_name(self.tensor.dtype)}

    def close(self) -> None:
        """Remove the file (this process's tensor stays usable until dropped); idempotent."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        atexit.unregister(self.close)


def map_pool(path: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Map a SharedMemoryPool file read-only as a tensor (a write through it would fault)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(mapped) != nbytes:
        raise TransferError(f"{path} holds {len(mapped)} bytes, its descriptor says {nbytes}")
    with warnings.catch_warnings():
        # torch warns that the buffer is read-only; that is the point: we only read it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapped, dtype=dtype).view(*shape)


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(self) -> None:
        self._pools: dict[str, torch.Tensor] = {}  # path -> read-only mapping

    def _source(self, info: dict[str, Any]) -> torch.Tensor:
        path = info["path"]
        pool = self._pools.get(path)
        if pool is None:
            # Sources that went away since (their file is gone) release their mappings now.
            for stale in [p for p in self._pools if not os.path.exists(p)]:
                del self._pools[stale]
            try:
                pool = map_pool(path, info["shape"], dtype_from_name(info["dtype"]))
            except OSError as e:
                raise TransferError(f"cannot map source pool {path}: {e}") from e
            self._pools[path] = pool
        return pool

    def _pull(self, desc: HandoffDescriptor, info: dict[str, Any], dst_pool: torch.Tensor,
              dst_block_ids: list[int], timeout_s: float) -> int | None:
        """On a CPU pool of the source's dtype: the copy and the checksum of the words it
        copies in one pass on this thread (kernels.block_sums_cpu.copy_block_sums), where
        torch's copy and then the checksum read everything twice on two OpenMP threads; else
        the copy, then pull()'s checksum."""
        src = self._source(info)
        check_source(desc, src)
        if (src.dtype == dst_pool.dtype and block_sums_cpu.serves(src)
                and block_sums_cpu.serves(dst_pool)):
            sums = block_sums_cpu.copy_block_sums(
                src, dst_pool, torch.tensor(desc.block_ids, dtype=torch.long),
                torch.tensor(dst_block_ids, dtype=torch.long))
            return combine(sums.tolist())
        copy_blocks(src, desc.block_ids, dst_pool, dst_block_ids)
        return None

    def close(self) -> None:
        self._pools.clear()

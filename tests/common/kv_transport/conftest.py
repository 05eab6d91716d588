"""Fixtures for the transport tests: a pool-owning child process (the prefill side)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.registry import HandoffDescriptor

ROOT = Path(__file__).resolve().parents[3]
OWNER = Path(__file__).with_name("pool_owner.py")


class PoolOwner:
    """A child process holding a seeded pool; see pool_owner.py."""

    def __init__(self, kind: str, seed: int, shape: list[int], block_ids: list[int]):
        args = [sys.executable, str(OWNER), kind, str(seed), ",".join(map(str, shape)),
                ",".join(map(str, block_ids))]
        path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pool owner exited with {self.proc.wait()}")
        self.desc = HandoffDescriptor.from_json(line)

    def command(self, text: str) -> str:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        """SIGKILL, as a source that dies mid-step."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def exit(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        code = self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()
        return code


@pytest.fixture
def pool_owner() -> Iterator[Callable[..., PoolOwner]]:
    owners: list[PoolOwner] = []

    def start(kind: str, seed: int, shape: list[int], block_ids: list[int]) -> PoolOwner:
        owners.append(PoolOwner(kind, seed, shape, block_ids))
        return owners[-1]

    yield start
    for owner in owners:
        if owner.proc.poll() is None:
            owner.proc.kill()
        owner.exit()

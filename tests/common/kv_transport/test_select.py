from __future__ import annotations

from typing import Any

import pytest

from common.errors import TransferError
from common.kv_transport.blocks import KV_LAYOUT
from common.kv_transport.locality import process_id
from common.kv_transport.select import select_transport
from common.registry import HandoffDescriptor

HERE = "host-a"


def _desc(offers: dict[str, dict[str, Any]], host: str = HERE) -> HandoffDescriptor:
    return HandoffDescriptor(
        request_id="r1", source_instance="p1", source_address="10.0.0.1:1", source_host_id=host,
        model="m", dtype="float32", block_size=4, layout=KV_LAYOUT, num_layers=1, num_kv_heads=1,
        head_dim=4, num_tokens=4, block_ids=[0], block_hashes=[], checksum=0, transports=offers)


SHM = {"shm": {"path": "/dev/shm/x", "shape": [1, 2, 1, 4, 1, 4], "dtype": "float32"}}
IPC = {"cuda_ipc": {"handle": "aGFuZGxl"}}
GRPC = {"grpc": {"address": "10.0.0.1:1"}}


def _local(pid: str) -> dict[str, dict[str, Any]]:
    return {"local": {"process_id": pid, "instance_id": "p1"}}


@pytest.mark.parametrize(("offers", "host", "device", "want"), [
    ({**_local("me"), **SHM, **GRPC}, HERE, "cpu", "local"),
    ({**_local("me"), **IPC, **GRPC}, HERE, "cuda", "local"),
    ({**_local("other"), **SHM, **GRPC}, HERE, "cpu", "shm"),
    ({**_local("other"), **IPC, **GRPC}, HERE, "cuda", "cuda_ipc"),
    ({**_local("other"), **SHM, **GRPC}, HERE, "cuda", "shm"),      # CPU source, GPU receiver
    ({**_local("other"), **IPC, **GRPC}, HERE, "cpu", "grpc"),      # GPU source, CPU receiver
    ({**_local("other"), **SHM, **GRPC}, "host-b", "cpu", "grpc"),
    ({**_local("other"), **IPC, **GRPC}, "host-b", "cuda:1", "grpc"),
])
def test_select_by_locality(offers, host: str, device: str, want: str) -> None:
    if "local" in offers and offers["local"]["process_id"] == "me":
        offers = {**offers, **_local(process_id())}
    assert select_transport(_desc(offers, host), HERE, device) == want


def test_nothing_reachable() -> None:
    with pytest.raises(TransferError, match="none reachable"):
        select_transport(_desc({**_local("other"), **SHM}, "host-b"), HERE, "cpu")

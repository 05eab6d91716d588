"""Choosing a transport by locality, and KVReceiver, the decode side's entry point."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.errors import TransferError
from common.kv_transport.base import KVTransport
from common.kv_transport.cuda_ipc import CudaIpcTransport
from common.kv_transport.grpc_transport import GrpcTransport
from common.kv_transport.local import LocalTransport
from common.kv_transport.locality import host_id, process_id
from common.kv_transport.shm import ShmTransport
from common.registry.records import HandoffDescriptor
from common.serving.tls import PLAINTEXT, TlsConfig

TRANSPORTS: dict[str, type[KVTransport]] = {
    t.name: t for t in (LocalTransport, ShmTransport, CudaIpcTransport, GrpcTransport)}


def make_transport(name: str, tls: TlsConfig = PLAINTEXT) -> KVTransport:
    """A new transport by name; tls is how grpc dials sources (the others stay on this host)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {sorted(TRANSPORTS)}")
    if name == GrpcTransport.name:
        return GrpcTransport(tls=tls)
    return TRANSPORTS[name]()


def select_transport(desc: HandoffDescriptor, receiver_host_id: str,
                     device: torch.device | str) -> str:
    """The cheapest transport the source offers that reaches it from here:

        same process                       -> local
        same host, CUDA destination pool   -> cuda_ipc (if offered), else shm
        same host, CPU destination pool    -> shm
        anywhere                           -> grpc
    """
    offers = desc.transports
    if "local" in offers and offers["local"].get("process_id") == process_id():
        return "local"
    if desc.source_host_id == receiver_host_id:
        if torch.device(device).type == "cuda" and "cuda_ipc" in offers:
            return "cuda_ipc"
        if "shm" in offers:
            return "shm"
    if "grpc" in offers:
        return "grpc"
    raise TransferError(f"handoff {desc.request_id} offers {sorted(offers)}, none reachable "
                        f"from host {receiver_host_id!r} on {device}")


class KVReceiver:
    """Pulls handoffs into a pool over whichever transport suits each source (one transport
    object per name, created on first use, keeping its per-source state). tls: the receiving
    process's TlsConfig, with which grpc dials sources that serve KVTransferService over TLS."""

    def __init__(self, host: str | None = None, timeout_s: float = 30.0,
                 tls: TlsConfig = PLAINTEXT):
        self.host = host if host is not None else host_id()
        self.timeout_s = timeout_s
        self.tls = tls
        self._transports: dict[str, KVTransport] = {}

    def transport(self, name: str) -> KVTransport:
        if name not in self._transports:
            self._transports[name] = make_transport(name, self.tls)
        return self._transports[name]

    def pull(self, desc: HandoffDescriptor, dst_pool: torch.Tensor,
             dst_block_ids: Sequence[int], after: torch.cuda.Event | None = None) -> str:
        """KVTransport.pull over the selected transport; returns its name (for metrics)."""
        name = select_transport(desc, self.host, dst_pool.device)
        self.transport(name).pull(desc, dst_pool, dst_block_ids, self.timeout_s, after)
        return name

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()

"""grpc: the transport that works across hosts. The prefill service serves KVTransferService (see
protos/splitserve/v1/kv_transfer.proto) from its pool; a receiver pulls the blocks as a stream of
chunks into a host buffer, then copies them into its pool. Under tensor parallelism each rank of
the receiver pulls its own shard (the offer names the source rank: PullBlocksRequest.
tensor_parallel_rank), which the source's rank 0 asks that rank for (common/engine/rank_kv.py).

KVTransferServicer is a grpc.aio servicer (the services run grpc.aio servers); the client side is
synchronous, for a worker thread, with one deadline over the whole stream.

TLS: the servicer runs on the prefill service's own gRPC server, so it serves TLS (or mTLS) when
that server does. GrpcTransport dials with the receiving process's TlsConfig (common/serving/tls.py): a
secure channel, presenting its certificate to a server that asks for one, when TLS is configured.
A mismatch (TLS against a plaintext source, a source certificate the CA does not verify, no
client certificate for an mTLS source) fails the handshake: the pull ends in a TransferError
naming UNAVAILABLE, at once, and never waits for its deadline.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Protocol

import grpc
import torch

from common.errors import TransferError
from common.kv_transport.base import KVTransport
from common.kv_transport.blocks import copy_blocks, dtype_from_name, dtype_name
from common.registry.records import HandoffDescriptor
from common.serving.tls import PLAINTEXT, TlsConfig, sync_channel
from protos.splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20


class KVExporter(Protocol):
    def export_kv(self, block_ids: list[int], rank: int = 0) -> torch.Tensor:
        """[num_layers, 2, len(block_ids), block_size, kv_heads, head_dim], a copy of tensor
        parallel rank `rank`'s pool; ValueError or IndexError for a block id outside the pool
        or a rank the source does not have."""
        ...


def _export_bytes(source: KVExporter, block_ids: list[int],
                  rank: int) -> tuple[memoryview, torch.Tensor]:
    kv = source.export_kv(block_ids, rank).detach().to("cpu").contiguous()
    return memoryview(kv.view(-1).view(torch.uint8).numpy()), kv


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    """Serves a source's blocks. The source is a KVSource (or anything with export_kv that is safe
    to call from a worker thread). Register with
    kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server(servicer, aio_server)."""

    def __init__(self, source: KVExporter):
        self._source = source

    async def PullBlocks(self, request: kv_transfer_pb2.PullBlocksRequest,
                         context: grpc.aio.ServicerContext):
        block_ids = list(request.block_ids)
        chunk = request.max_chunk_bytes or DEFAULT_CHUNK_BYTES
        if not block_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no block ids")
        if chunk > MAX_CHUNK_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_chunk_bytes {chunk} above {MAX_CHUNK_BYTES}")
        try:
            data, kv = await asyncio.to_thread(_export_bytes, self._source, block_ids,
                                               request.tensor_parallel_rank)
        except (ValueError, IndexError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        total = len(data)
        for offset in range(0, total, chunk):
            first = offset == 0
            yield kv_transfer_pb2.PullBlocksResponse(
                offset=offset, data=bytes(data[offset:offset + chunk]), total_bytes=total,
                shape=list(kv.shape) if first else [], dtype=dtype_name(kv.dtype) if first else "")


class GrpcTransport(KVTransport):
    name = "grpc"

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, tls: TlsConfig = PLAINTEXT):
        """tls: how sources are dialled (this process's TlsConfig; PLAINTEXT: insecure)."""
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.tls = tls
        self._channels: dict[str, tuple[grpc.Channel, kv_transfer_pb2_grpc.KVTransferServiceStub]] = {}

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferServiceStub:
        if address not in self._channels:
            limit = self.chunk_bytes + (1 << 20)
            try:
                channel = sync_channel(address, self.tls,
                                       options=[("grpc.max_receive_message_length", limit)])
            except OSError as e:  # a TLS file went away since start-up
                raise TransferError(f"cannot dial {address} over TLS: {e}") from e
            self._channels[address] = (channel, kv_transfer_pb2_grpc.KVTransferServiceStub(channel))
        return self._channels[address][1]

    def _pull(self, desc: HandoffDescriptor, info: dict[str, Any], dst_pool: torch.Tensor,
              dst_block_ids: list[int], timeout_s: float) -> None:
        n = len(desc.block_ids)
        shape = [desc.num_layers, 2, n, desc.block_size, desc.num_kv_heads, desc.head_dim]
        dtype = dtype_from_name(desc.dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        request = kv_transfer_pb2.PullBlocksRequest(
            request_id=desc.request_id, block_ids=desc.block_ids, max_chunk_bytes=self.chunk_bytes,
            tensor_parallel_rank=info.get("rank", 0))
        received = 0
        address = info["address"]
        call = self._stub(address).PullBlocks(request, timeout=timeout_s)
        try:
            for chunk in call:
                if received == 0 and (list(chunk.shape) != shape or chunk.dtype != desc.dtype
                                      or chunk.total_bytes != nbytes):
                    raise TransferError(f"source sends {list(chunk.shape)} {chunk.dtype}, "
                                        f"expected {shape} {desc.dtype}")
                size = len(chunk.data)
                if chunk.offset != received or received + size > nbytes:
                    raise TransferError(f"chunk at {chunk.offset}+{size} after {received} bytes "
                                        f"of {nbytes}")
                view[received:received + size] = chunk.data
                received += size
        except grpc.RpcError as e:
            mode = "TLS" if self.tls.dials_tls else "plaintext"
            raise TransferError(f"PullBlocks from {address} over {mode} failed: "
                                f"{e.code().name}: {e.details()}") from e
        finally:
            call.cancel()  # no-op once the stream ended; stops the server after an error here
        if received != nbytes:
            raise TransferError(f"stream ended after {received} of {nbytes} bytes")
        kv = buf.view(dtype).view(shape)
        copy_blocks(kv, range(n), dst_pool, dst_block_ids)

    def close(self) -> None:
        for channel, _ in self._channels.values():
            channel.close()
        self._channels.clear()

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from common.errors import TransferError
from common.kv_transport.grpc_transport import GrpcTransport, KVTransferServicer
from common.kv_transport.select import KVReceiver
from common.kv_transport.source import KVSource
from common.registry import HandoffDescriptor
from common.registry.embedded import free_port
from common.serving.tls import PLAINTEXT, TlsConfig, add_port
from protos.splitserve.v1 import kv_transfer_pb2_grpc
from tests.certs import Issuer, Leaf, make_ca, make_leaf

SHAPE = [3, 2, 16, 4, 2, 8]  # layers, kv, blocks, block_size, kv_heads, head_dim


class AioServer:
    """A grpc.aio server (as the services run) on its own event loop thread, serving TLS when
    tls says so (as a prefill service's server does)."""

    def __init__(self, servicer: KVTransferServicer, tls: TlsConfig = PLAINTEXT):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.port = self._run(self._start(servicer, tls))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start(self, servicer: KVTransferServicer,
                     tls: TlsConfig) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server(servicer, server)
        port = add_port(server, "127.0.0.1:0", tls)
        await server.start()
        return server, port

    def stop(self) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class SlowExporter:
    def __init__(self, source: KVSource, delay_s: float):
        self.source = source
        self.delay_s = delay_s

    def export_kv(self, block_ids: list[int], rank: int = 0) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.source.export_kv(block_ids, rank)


@pytest.fixture
def serve() -> Iterator[Callable[..., int]]:
    servers: list[AioServer] = []

    def start(exporter, tls: TlsConfig = PLAINTEXT) -> int:
        servers.append(AioServer(KVTransferServicer(exporter), tls))
        return servers[-1].port

    yield start
    for s in servers:
        s.stop()


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


def _source(dtype: torch.dtype = torch.float32, device: str = "cpu") -> KVSource:
    pool = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    return KVSource("prefill-remote", pool, "test-model")


def _remote_desc(source: KVSource, address: str, block_ids: list[int]) -> HandoffDescriptor:
    """A descriptor of source's blocks as a receiver on another host sees it: grpc only."""
    desc = source.describe("r1", block_ids, num_tokens=4 * len(block_ids), block_hashes=[])
    return dataclasses.replace(desc, source_host_id="elsewhere",
                               transports={"grpc": {"address": address}})


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pull_over_grpc_in_chunks(serve, dtype: torch.dtype, device: str) -> None:
    source = _source(dtype, device)
    port = serve(source)
    desc = _remote_desc(source, f"127.0.0.1:{port}", [9, 3, 4, 5, 15])
    dst = torch.zeros([3, 2, 7, 4, 2, 8], dtype=dtype, device=device)
    receiver = KVReceiver(timeout_s=10)
    receiver.transport("grpc").chunk_bytes = 1000  # about 8 chunks
    assert receiver.pull(desc, dst, [6, 0, 1, 2, 3]) == "grpc"
    for s, d in [(9, 6), (3, 0), (4, 1), (5, 2), (15, 3)]:
        assert torch.equal(dst[:, :, d], source.pool[:, :, s])
    assert torch.count_nonzero(dst[:, :, [4, 5]]) == 0
    receiver.close()
    source.close()


def test_checksum_mismatch_is_a_transfer_error(serve) -> None:
    source = _source()
    desc = _remote_desc(source, f"127.0.0.1:{serve(source)}", [1, 2])
    transport = GrpcTransport()
    with pytest.raises(TransferError, match="checksum mismatch"):
        transport.pull(dataclasses.replace(desc, checksum=desc.checksum + 1),
                       torch.zeros([3, 2, 2, 4, 2, 8]), [0, 1])
    transport.pull(desc, torch.zeros([3, 2, 2, 4, 2, 8]), [0, 1])  # the true checksum passes
    transport.close()
    source.close()


def test_bad_block_id_is_a_transfer_error(serve) -> None:
    source = _source()
    desc = _remote_desc(source, f"127.0.0.1:{serve(source)}", [1])
    transport = GrpcTransport()
    with pytest.raises(TransferError, match="INVALID_ARGUMENT"):
        transport.pull(dataclasses.replace(desc, block_ids=[99]), torch.zeros([3, 2, 2, 4, 2, 8]),
                       [0])
    transport.close()
    source.close()


def test_slow_source_times_out(serve) -> None:
    source = _source()
    desc = _remote_desc(source, f"127.0.0.1:{serve(SlowExporter(source, delay_s=2.0))}", [1])
    transport = GrpcTransport()
    start = time.monotonic()
    with pytest.raises(TransferError, match="DEADLINE_EXCEEDED"):
        transport.pull(desc, torch.zeros([3, 2, 2, 4, 2, 8]), [0], timeout_s=0.3)
    assert time.monotonic() - start < 1.5
    transport.close()
    source.close()


def test_unreachable_source_is_a_transfer_error() -> None:
    source = _source()
    desc = _remote_desc(source, f"127.0.0.1:{free_port()}", [1])  # nobody listens there
    transport = GrpcTransport()
    with pytest.raises(TransferError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
        transport.pull(desc, torch.zeros([3, 2, 2, 4, 2, 8]), [0], timeout_s=2.0)
    transport.close()
    source.close()


# ---- TLS: the KVTransferService service on a TLS (or mTLS) server, as a prefill service serves it -----

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Issuer | Leaf]:
    d = tmp_path_factory.mktemp("kv-pki")
    ca, rogue_ca = make_ca(d, "ca"), make_ca(d, "rogue-ca")
    return {"ca": ca, "rogue_ca": rogue_ca, "prefill": make_leaf(d, "prefill", ca),
            "decode": make_leaf(d, "decode", ca)}


def _raw(blocks: torch.Tensor) -> bytes:
    return blocks.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mtls"])
def test_pull_over_tls(serve, pki, client_auth: bool) -> None:
    source = _source(torch.bfloat16)
    port = serve(source, pki["prefill"].tls(pki["ca"], client_auth=client_auth))
    desc = _remote_desc(source, f"127.0.0.1:{port}", [9, 3, 4, 5, 15])
    dst = torch.zeros([3, 2, 7, 4, 2, 8], dtype=torch.bfloat16)
    # As the decode service dials: its own certificate and key (presented when the source asks
    # for one), the CA that signed the source's.
    receiver = KVReceiver(timeout_s=10, tls=pki["decode"].tls(pki["ca"]))
    receiver.transport("grpc").chunk_bytes = 1000  # about 4 chunks
    assert receiver.pull(desc, dst, [6, 0, 1, 2, 3]) == "grpc"
    assert _raw(dst[:, :, [6, 0, 1, 2, 3]]) == _raw(source.pool[:, :, [9, 3, 4, 5, 15]])
    assert torch.count_nonzero(dst[:, :, [4, 5]]) == 0
    receiver.close()
    source.close()


def _mismatches(pki) -> dict[str, tuple[TlsConfig, TlsConfig, str]]:
    """name -> (source's server TLS, receiver's TLS, what the receiver's error says)."""
    ca, rogue_ca = str(pki["ca"].cert_path), str(pki["rogue_ca"].cert_path)
    server_tls = pki["prefill"].tls(pki["ca"])
    return {
        "tls_to_plaintext": (PLAINTEXT, TlsConfig(tls_ca=ca), "over TLS failed: UNAVAILABLE"),
        "wrong_ca": (server_tls, TlsConfig(tls_ca=rogue_ca),
                     "over TLS failed: UNAVAILABLE.*CERTIFICATE_VERIFY_FAILED"),
        "no_client_cert": (pki["prefill"].tls(pki["ca"], client_auth=True),
                           TlsConfig(tls_ca=ca), "over TLS failed: UNAVAILABLE"),
        "plaintext_to_tls": (server_tls, PLAINTEXT, "over plaintext failed: UNAVAILABLE"),
    }


@pytest.mark.parametrize("case", ["tls_to_plaintext", "wrong_ca", "no_client_cert",
                                  "plaintext_to_tls"])
def test_tls_mismatch_fails_the_pull_at_once(serve, pki, case: str) -> None:
    server_tls, client_tls, error = _mismatches(pki)[case]
    source = _source()
    desc = _remote_desc(source, f"127.0.0.1:{serve(source, server_tls)}", [1, 2])
    receiver = KVReceiver(timeout_s=10, tls=client_tls)
    start = time.monotonic()
    with pytest.raises(TransferError, match=error):
        receiver.pull(desc, torch.zeros([3, 2, 2, 4, 2, 8]), [0, 1])
    assert time.monotonic() - start < 5  # the handshake fails; the deadline is not waited for
    receiver.close()
    source.close()

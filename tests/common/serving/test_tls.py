"""TLS and mTLS on a real grpc.aio server (the health service), dialled by real channels."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from common.serving.tls import TlsConfig, add_port, aio_channel, sync_channel
from tests.certs import Issuer, Leaf, make_ca, make_leaf


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Issuer | Leaf]:
    d: Path = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = make_ca(d, "ca"), make_ca(d, "rogue-ca")
    return {"ca": ca, "rogue_ca": rogue_ca, "server": make_leaf(d, "server", ca),
            "client": make_leaf(d, "client", ca), "rogue": make_leaf(d, "rogue", rogue_ca),
            "elsewhere": make_leaf(d, "elsewhere", ca, hosts=("svc.internal",))}


def check(address: str, tls: TlsConfig, timeout: float = 5.0) -> int:
    with sync_channel(address, tls) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=timeout)
    return reply.status


async def serve(tls: TlsConfig) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = add_port(server, "127.0.0.1:0", tls)
    assert port > 0
    await server.start()
    return server, f"127.0.0.1:{port}"


def run_with_server(tls: TlsConfig, fn) -> None:
    """Serve on an asyncio loop in this thread while fn(address) dials it from another."""

    async def main() -> None:
        server, address = await serve(tls)
        try:
            await asyncio.to_thread(fn, address)
        finally:
            await server.stop(None)

    asyncio.run(main())


def rpc_error(fn, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args)
    return err.value


def test_tls_server_serves_verified_clients_and_refuses_plaintext(pki):
    server_tls = pki["server"].tls(pki["ca"])

    def dial(address: str) -> None:
        assert check(address, TlsConfig(tls_ca=str(pki["ca"].cert_path))) == 1  # SERVING
        # Plaintext against a TLS port: the handshake never completes.
        assert rpc_error(check, address, TlsConfig(), 2.0).code() in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        # A client trusting another CA refuses the server's certificate.
        err = rpc_error(check, address, TlsConfig(tls_ca=str(pki["rogue_ca"].cert_path)), 2.0)
        assert err.code() == grpc.StatusCode.UNAVAILABLE

    run_with_server(server_tls, dial)


def test_server_name_override_for_certificates_issued_to_a_service_name(pki):
    server_tls = pki["elsewhere"].tls(pki["ca"])

    def dial(address: str) -> None:
        ca = str(pki["ca"].cert_path)
        err = rpc_error(check, address, TlsConfig(tls_ca=ca), 2.0)  # 127.0.0.1 not in the cert
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert check(address, TlsConfig(tls_ca=ca, tls_server_name="svc.internal")) == 1

    run_with_server(server_tls, dial)


def test_mtls_requires_a_client_certificate_from_the_ca(pki):
    server_tls = pki["server"].tls(pki["ca"], client_auth=True)

    def dial(address: str) -> None:
        assert check(address, pki["client"].tls(pki["ca"])) == 1
        # No client certificate, or one from another CA: refused in the handshake.
        err = rpc_error(check, address, TlsConfig(tls_ca=str(pki["ca"].cert_path)), 2.0)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        rogue = TlsConfig(tls_cert=str(pki["rogue"].cert_path),
                          tls_key=str(pki["rogue"].key_path), tls_ca=str(pki["ca"].cert_path))
        assert rpc_error(check, address, rogue, 2.0).code() == grpc.StatusCode.UNAVAILABLE

    run_with_server(server_tls, dial)


def test_aio_channel_dials_tls(pki):
    async def main() -> None:
        server, address = await serve(pki["server"].tls(pki["ca"], client_auth=True))
        try:
            async with aio_channel(address, pki["client"].tls(pki["ca"])) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_config_validation_and_flags(pki, tmp_path):
    cert, key = str(pki["server"].cert_path), str(pki["server"].key_path)
    ca = str(pki["ca"].cert_path)
    assert not TlsConfig().serves_tls and not TlsConfig().dials_tls
    assert TlsConfig().server_credentials() is None and TlsConfig().channel_credentials() is None
    assert TlsConfig(tls_ca=ca).dials_tls and not TlsConfig(tls_ca=ca).serves_tls
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TlsConfig(tls_cert=cert)
    with pytest.raises(ValueError, match="--tls-client-auth needs"):
        TlsConfig(tls_cert=cert, tls_key=key, tls_client_auth=True)
    with pytest.raises(ValueError, match="--tls-ca: no such file"):
        TlsConfig(tls_ca=str(tmp_path / "missing.pem"))
    full = TlsConfig(tls_cert=cert, tls_key=key, tls_ca=ca, tls_client_auth=True,
                     tls_server_name="svc")
    assert full.to_argv() == ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
                              "--tls-client-auth", "--tls-server-name", "svc"]
    parser = argparse.ArgumentParser()
    TlsConfig.add_cli_args(parser)
    assert TlsConfig.from_cli_args(parser.parse_args(full.to_argv())) == full
    assert TlsConfig.from_cli_args(parser.parse_args([])) == TlsConfig()

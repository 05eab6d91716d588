"""TLS on every gRPC endpoint, and mutual TLS between the services (no torch).

One TlsConfig per process, from the same four flags on every command:

    --tls-cert, --tls-key   this process's certificate chain and private key (PEM files). A server
                            with them serves TLS only; as a client, the process presents them to a
                            server that asks for a client certificate (mTLS).
    --tls-ca                CA bundle (PEM) that signed the servers this process dials; without
                            it, the system's roots. With --tls-client-auth it also verifies clients.
    --tls-client-auth       this process's servers require a client certificate signed by
                            --tls-ca (mTLS between services).
    --tls-server-name       the name every dialled server's certificate must carry, when it is not
                            the host in the address (certificates issued for a service name).

With no flag set, TLS is off: servers listen in plaintext and channels are insecure. Clients turn
TLS on with --tls-ca alone (the gateway dialling services that serve TLS, `splitserve generate`).
Files are read once, at start-up, and a missing or unreadable one fails it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.flags import add_args, from_args, opt, to_argv


@dataclass(frozen=True, slots=True)
class TlsConfig:
    tls_cert: str | None = opt(None, "PEM certificate chain of this process: its gRPC servers "
                               "serve TLS only, and it is presented as the client certificate "
                               "(mTLS)")
    tls_key: str | None = opt(None, "PEM private key of --tls-cert")
    tls_ca: str | None = opt(None, "PEM CA bundle that verifies the servers this process dials "
                             "(default: the system roots once TLS is on) and, with "
                             "--tls-client-auth, its clients")
    tls_client_auth: bool = opt(False, "require clients to present a certificate signed by "
                                "--tls-ca (mTLS)")
    tls_server_name: str | None = opt(None, "name the dialled servers' certificates must carry "
                                      "(default: the host of each address)")

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_auth and (self.tls_cert is None or self.tls_ca is None):
            raise ValueError("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                           ("--tls-ca", self.tls_ca)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file {path!r}")

    @property
    def serves_tls(self) -> bool:
        """This process's servers listen with TLS."""
        return self.tls_cert is not None

    @property
    def dials_tls(self) -> bool:
        """This process's channels use TLS (any TLS flag turns it on)."""
        return self.tls_cert is not None or self.tls_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials for add_secure_port, or None: listen in plaintext."""
        if not self.serves_tls:
            return None
        pair = (_read(self.tls_key), _read(self.tls_cert))
        return grpc.ssl_server_credentials(
            [pair], root_certificates=_read(self.tls_ca) if self.tls_client_auth else None,
            require_client_auth=self.tls_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for secure channels, or None: dial in plaintext."""
        if not self.dials_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca) if self.tls_ca else None,
            private_key=_read(self.tls_key) if self.tls_key else None,
            certificate_chain=_read(self.tls_cert) if self.tls_cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.dials_tls and self.tls_server_name:
            return [("grpc.ssl_target_name_override", self.tls_server_name)]
        return []

    @property
    def scheme(self) -> str:
        """For messages and URLs: "https" when servers serve TLS, else "http"."""
        return "https" if self.serves_tls else "http"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_args(cls, parser, "TLS")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> TlsConfig:
        return from_args(cls, args)

    def to_argv(self) -> list[str]:
        """The flags that rebuild this config (for `splitserve up` and the tests)."""
        return to_argv(self)


PLAINTEXT = TlsConfig()  # no TLS: the default of every server and channel


def _read(path: str | None) -> bytes:
    if path is None:
        raise ValueError("no file given")
    return Path(path).read_bytes()


def add_port(server: grpc.aio.Server | grpc.Server, address: str, tls: TlsConfig) -> int:
    """Bind address on server with TLS when configured; the port (0 if binding failed)."""
    creds = tls.server_credentials()
    if creds is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, creds)


def aio_channel(address: str, tls: TlsConfig,
                options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to address: secure when TLS is configured, else plaintext."""
    creds = tls.channel_credentials()
    opts = [*options, *tls.channel_options()]
    if creds is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, creds, options=opts)


def sync_channel(address: str, tls: TlsConfig,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking channel to address (worker threads, CLI clients, tests)."""
    creds = tls.channel_credentials()
    opts = [*options, *tls.channel_options()]
    if creds is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, creds, options=opts)

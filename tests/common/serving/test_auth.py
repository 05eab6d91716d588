"""API keys: the gRPC interceptor on a real grpc.aio server, the ASGI middleware in front of a
real FastAPI app served by uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import uvicorn
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from common.registry.embedded import free_port
from common.serving.auth import (
    MISSING,
    WRONG,
    ApiKeyInterceptor,
    ApiKeyMiddleware,
    ApiKeys,
    AuthConfig,
    bearer_metadata,
)

KEY = "sk-test-0123456789"


def test_refusal_rules():
    keys = ApiKeys([KEY, "second-key"])
    assert keys.refusal(f"Bearer {KEY}") is None
    assert keys.refusal("bearer second-key") is None  # the scheme is case-insensitive
    assert keys.refusal(None) == MISSING
    assert keys.refusal(KEY) == MISSING  # no scheme
    assert keys.refusal("Basic abc") == MISSING
    assert keys.refusal("Bearer sk-test") == WRONG
    assert keys.refusal("Bearer ") == WRONG
    assert ApiKeys().refusal(None) is None and not ApiKeys().enabled
    with pytest.raises(ValueError):
        ApiKeys([""])


def test_config_reads_keys_from_file_and_flag(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated 2026-01\nold-key\n\n  new-key  \n")
    parser = argparse.ArgumentParser()
    AuthConfig.add_cli_args(parser)
    config = AuthConfig.from_cli_args(parser.parse_args(
        ["--api-key", KEY, "--api-key-file", str(path)]))
    keys = config.keys()
    assert [keys.refusal(f"Bearer {k}") for k in (KEY, "old-key", "new-key", "# rotated")] == [
        None, None, None, WRONG]
    assert not AuthConfig().keys().enabled
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        AuthConfig(api_key_file=str(empty)).keys()
    with pytest.raises(ValueError, match="no such file"):
        AuthConfig(api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="must not be empty"):
        AuthConfig(api_key=" ")


def test_grpc_interceptor_guards_every_call_kind_but_health():
    """Health (unary and server-streaming) stays open by default; reflection (bidirectional
    stream) needs the key; with no open prefixes, health needs it too."""

    async def main() -> None:
        servers = []
        addresses = []
        for open_prefixes in (None, ()):
            kwargs = {} if open_prefixes is None else {"open_prefixes": open_prefixes}
            server = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys([KEY]), **kwargs)])
            health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
            reflection.enable_server_reflection(
                ("grpc.health.v1.Health", reflection.SERVICE_NAME), server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        try:
            await asyncio.to_thread(dial, *addresses)
        finally:
            for server in servers:
                await server.stop(None)

    def dial(default: str, closed: str) -> None:
        with grpc.insecure_channel(default) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
            with pytest.raises(grpc.RpcError) as err:
                next(reflect.ServerReflectionInfo(iter(ask), timeout=5))
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, MISSING)
            reply = next(reflect.ServerReflectionInfo(iter(ask), timeout=5,
                                                      metadata=bearer_metadata(KEY)))
            assert "grpc.health.v1.Health" in {
                s.name for s in reply.list_services_response.service}
        with grpc.insecure_channel(closed) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for metadata, why in (((), MISSING), (bearer_metadata("nope"), WRONG)):
                with pytest.raises(grpc.RpcError) as err:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=metadata)
                assert (err.value.code(), err.value.details()) == (
                    grpc.StatusCode.UNAUTHENTICATED, why)
                with pytest.raises(grpc.RpcError) as err:
                    next(health.Watch(health_pb2.HealthCheckRequest(), timeout=5,
                                      metadata=metadata))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5,
                                 metadata=bearer_metadata(KEY))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(main())


@pytest.fixture(scope="module")
def http_url():
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/v1/completions")
    def completions(body: dict) -> dict:
        return {"echo": body}

    app.add_middleware(ApiKeyMiddleware, keys=ApiKeys([KEY]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def post(url: str, headers: dict[str, str]) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=b'{"prompt": "hi"}', method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_http_middleware_answers_401_in_openai_shape(http_url):
    url = f"{http_url}/v1/completions"
    status, headers, body = post(url, {})
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert body == {"error": {"message": MISSING, "type": "authentication_error", "param": None,
                              "code": 401}}
    status, _, body = post(url, {"authorization": "Bearer wrong"})
    assert (status, body["error"]["message"]) == (401, WRONG)
    status, _, body = post(url, {"authorization": f"Bearer {KEY}"})
    assert (status, body) == (200, {"echo": {"prompt": "hi"}})
    with urllib.request.urlopen(f"{http_url}/health", timeout=5) as r:  # open without a key
        assert json.loads(r.read()) == {"ok": True}

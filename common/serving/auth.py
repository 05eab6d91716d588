"""API keys on the gateway's public endpoints: gRPC (an interceptor) and HTTP (ASGI middleware).

A client sends `authorization: Bearer <key>`: as gRPC metadata, or as the HTTP header (what
OpenAI's clients send with api_key=...). A missing or wrong key gets UNAUTHENTICATED, or HTTP 401
with an OpenAI-style error body, before the request is even parsed. Health checks stay open so
probes need no key. Keys come from --api-key or --api-key-file (one key per line, so a new key
can be added before the old one is retired); with neither, the endpoints are open. Keys are
compared in constant time. No torch.
"""

from __future__ import annotations

import argparse
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.flags import add_args, from_args, opt
from common.text.openai_protocol import error_body

BEARER = "bearer "
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
OPEN_HTTP_PATHS = ("/health", "/health/live")
MISSING = "no API key: send the header `authorization: Bearer <key>`"
WRONG = "the API key is not valid"


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_key: str | None = opt(None, "API key clients must send (`authorization: Bearer KEY`); "
                              "prefer --api-key-file, which keeps the key out of the process "
                              "list")
    api_key_file: str | None = opt(None, "file with the accepted API keys, one per line (# starts "
                                   "a comment)")

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if self.api_key_file is not None and not Path(self.api_key_file).is_file():
            raise ValueError(f"--api-key-file: no such file {self.api_key_file!r}")

    def keys(self) -> ApiKeys:
        return ApiKeys(self._read())

    def client_key(self) -> str | None:
        """The key a client sends (the first one given), or None."""
        keys = self._read()
        return keys[0] if keys else None

    def _read(self) -> list[str]:
        keys = [self.api_key.strip()] if self.api_key else []
        if self.api_key_file:
            lines = Path(self.api_key_file).read_text().splitlines()
            from_file = [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
            if not from_file:
                raise ValueError(f"--api-key-file {self.api_key_file} holds no key")
            keys += from_file
        return keys

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_args(cls, parser, "authentication")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> AuthConfig:
        return from_args(cls, args)


NO_AUTH = AuthConfig()  # no key: the endpoints are open


class ApiKeys:
    """The accepted keys; an empty set accepts every request (authentication off)."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = [k.encode() for k in keys]
        if any(not k for k in self._keys):
            raise ValueError("API keys must not be empty")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def refusal(self, authorization: str | None) -> str | None:
        """Why a request with this authorization value is refused; None if it is accepted."""
        if not self._keys:
            return None
        if not authorization or authorization[:len(BEARER)].lower() != BEARER:
            return MISSING
        presented = authorization[len(BEARER):].strip().encode()
        # Every key is compared, so the time taken does not tell which one nearly matched.
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return None if any(matches) else WRONG


def _metadata_value(metadata: Sequence[tuple[str, Any]] | None, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def _deny(details: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses with UNAUTHENTICATED (requests are
    left undeserialized: an unauthenticated caller never reaches the parser)."""
    code = grpc.StatusCode.UNAUTHENTICATED

    async def unary_in(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    async def stream_in(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    async def unary_in_stream_out(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)
        yield  # pragma: no cover (abort raises)

    async def stream_in_stream_out(request_iterator: Any,
                                   context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)
        yield  # pragma: no cover (abort raises)

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary_in)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(unary_in_stream_out)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(stream_in)
    return grpc.stream_stream_rpc_method_handler(stream_in_stream_out)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted key (put it first among a server's interceptors)."""

    def __init__(self, keys: ApiKeys, open_prefixes: Sequence[str] = OPEN_GRPC_PREFIXES):
        self.keys = keys
        self.open_prefixes = tuple(open_prefixes)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.open_prefixes):
            return handler
        why = self.keys.refusal(_metadata_value(handler_call_details.invocation_metadata,
                                                "authorization"))
        return handler if why is None else _deny(why, handler)


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries api_key (empty without one), for gRPC clients."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ApiKeyMiddleware:
    """ASGI middleware: HTTP requests without an accepted key get 401 and an OpenAI-style error
    body. With FastAPI: `app.add_middleware(ApiKeyMiddleware, keys=keys)`."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], keys: ApiKeys,
                 open_paths: Sequence[str] = OPEN_HTTP_PATHS):
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                              if k.lower() == b"authorization"), None)
        why = self.keys.refusal(authorization)
        if why is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(why, "authentication_error", 401)).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

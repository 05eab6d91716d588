"""gRPC plumbing shared by every service: server construction (health checking and reflection),
the one place that maps exceptions to status codes, and graceful shutdown on SIGINT/SIGTERM.

Servicers stay thin: they raise a domain error (common/errors.py: each class carries its gRPC
status, a ServiceError the one it was raised with) or let an internal call's AioRpcError
through, and ErrorInterceptor turns that into the status the client sees (`status_of`). Imports
no torch and no engine module (the gateway uses it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import redis
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from common.errors import SplitserveError
from common.serving.tls import PLAINTEXT, TlsConfig, add_port, aio_channel

log = logging.getLogger("splitserve.grpc")

# KV blocks of long prompts travel in large messages (chunked, but chunks are megabytes).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# While calls are open, each side pings the other every KEEPALIVE_MS and drops the connection if
# no answer comes within KEEPALIVE_TIMEOUT_MS: a peer that hangs (stopped, or its host gone) fails
# its calls with UNAVAILABLE in seconds, and the gateway resumes them elsewhere, instead of
# waiting for the request's deadline. Servers accept pings that often.
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 4000, 4000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # else one minute, whatever the above
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_pings_without_data", 0),
]


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for an exception raised by a servicer."""
    if isinstance(exc, SplitserveError):
        return grpc.StatusCode[exc.grpc_status], exc.message or exc.grpc_status
    if isinstance(exc, grpc.aio.AioRpcError):  # an internal call failed: pass its status on
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if isinstance(exc, redis.RedisError):  # the caller may retry once the registry is back
        return grpc.StatusCode.UNAVAILABLE, f"the block registry is unreachable: {exc}"
    if isinstance(exc, DecodeError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def _abort_with(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    code, details = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    await context.abort(code, details)


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str,
                parse: Callable[[bytes], Any]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(parse(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with(context, exc, method)

    return unary


def _wrap_stream(fn: Callable[..., Any], method: str,
                 parse: Callable[[bytes], Any]) -> Callable[..., Any]:
    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in fn(parse(request), context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with(context, exc, method)

    return stream


def _parser(handler: grpc.RpcMethodHandler) -> Callable[[bytes], Any]:
    return handler.request_deserializer or (lambda raw: raw)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping splitserve.v1 servicer methods to gRPC status codes. Requests are
    parsed inside the wrapper, so a malformed one gets INVALID_ARGUMENT (grpc's own parsing would
    answer UNKNOWN)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith("/splitserve."):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, _parser(handler)),
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, _parser(handler)),
                response_serializer=handler.response_serializer)
        return handler


@dataclass(frozen=True, slots=True)
class Service:
    """A servicer, its generated `add_XServicer_to_server` function and its full proto name."""
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    name: str


def service_name(pb2_module: Any, service: str) -> str:
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


class GrpcServer:
    """An aio server with health checking, reflection and ErrorInterceptor.

    Built in two steps so the port is known before the servicers are: construct (binds host:port,
    0 picks a free port; TLS-only when `tls` has a certificate), add() the services, then start().
    `interceptors` run before ErrorInterceptor (an API-key check refuses before any parsing).
    """

    def __init__(self, host: str, port: int, max_concurrent_rpcs: int | None = None, *,
                 tls: TlsConfig = PLAINTEXT,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        self.server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()],
                                      options=CHANNEL_OPTIONS,
                                      maximum_concurrent_rpcs=max_concurrent_rpcs)
        self.port = add_port(self.server, f"{host}:{port}", tls)
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.health = health_aio.HealthServicer()
        self.service_names: list[str] = []

    def add(self, service: Service) -> None:
        service.add_to_server(service.servicer, self.server)
        self.service_names.append(service.name)

    async def start(self, serving: bool = True) -> None:
        """Start serving calls; health reports SERVING at once, or (serving=False) NOT_SERVING
        until set_serving(True) (a service becomes ready once it is registered)."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (*self.service_names, health_name, reflection.SERVICE_NAME), self.server)
        await self.server.start()
        await self.set_serving(serving)

    async def set_serving(self, serving: bool) -> None:
        """The health status of the server ("") and of every service added."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING (for good), refuse new calls, let in-flight calls finish within grace_s."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def wait_for_signal(signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> int:
    """Block until one of `signals` arrives; returns it."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()
    for sig in signals:
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s))
    try:
        return await received
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def channel(address: str, tls: TlsConfig) -> grpc.aio.Channel:
    """A channel to another splitserve service: TLS (and the client certificate, for mTLS) as
    configured, else plaintext."""
    return aio_channel(address, tls, CHANNEL_OPTIONS)

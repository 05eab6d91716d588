"""HttpError.of: the HTTP status and OpenAI error body a client of the HTTP API gets for each
exception (a domain error by its http_status, anything else by its gRPC status)."""

from __future__ import annotations

import grpc
import pytest

from common.errors import (
    ClientAborted,
    DeadlineExceededError,
    InvalidRequestError,
    NoFreeBlocksError,
    NoInstanceError,
    OverloadedError,
    ServiceError,
    SplitserveError,
    TransferError,
)
from gateway.http_api import HttpError


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (InvalidRequestError("the prompt is empty"), 400, "invalid_request_error"),
    (OverloadedError("retry later"), 429, "rate_limit_error"),
    (NoFreeBlocksError("need 4 blocks, 1 free"), 429, "rate_limit_error"),
    (NoInstanceError("no decode instance is registered"), 503, "service_unavailable_error"),
    (TransferError("checksum mismatch"), 503, "service_unavailable_error"),
    (DeadlineExceededError("the request's deadline passed"), 504, "timeout_error"),
    (ClientAborted("aborted"), 499, "cancelled"),
    (ServiceError(grpc.StatusCode.NOT_FOUND, "no resumable request"), 404, "not_found_error"),
    (ServiceError(grpc.StatusCode.ALREADY_EXISTS, "in flight"), 409, "conflict_error"),
    (SplitserveError("boom"), 500, "internal_error"),
])
def test_domain_errors_answer_their_http_status(exc: SplitserveError, status: int, kind: str):
    out = HttpError.of(exc)
    assert (out.status, out.message) == (status, exc.message)
    assert out.body()["error"]["type"] == kind
    assert out.response().status_code == status


def test_other_exceptions_answer_the_http_status_of_their_grpc_status():
    rpc = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                               grpc.aio.Metadata(), details="the pool is full")
    assert (HttpError.of(rpc).status, HttpError.of(rpc).message) == (429, "the pool is full")
    assert HttpError.of(TimeoutError()).status == 504
    assert HttpError.of(KeyError("x")).status == 500


def test_http_errors_pass_through():
    exc = HttpError(404, "the model 'x' does not exist", "model")
    assert HttpError.of(exc) is exc

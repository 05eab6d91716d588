"""common/errors.py: every domain error's gRPC and HTTP status, and grpc_util.status_of, which
reads them (the gateway's HTTP side: tests/gateway/test_http_errors.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import redis
from google.protobuf.message import DecodeError

from common import errors
from common.errors import (
    ClientAborted,
    ConfigError,
    DeadlineExceededError,
    EngineDroppedRequest,
    EngineLoopStopped,
    HandoffNotFoundError,
    InvalidRequestError,
    NoFreeBlocksError,
    NoInstanceError,
    OverloadedError,
    PeerGoneError,
    RankFailure,
    RequestCancelledError,
    ServiceError,
    SplitserveError,
    TransferError,
    UnavailableError,
)
from common.serving.grpc_util import status_of

ROOT = Path(__file__).resolve().parents[2]

STATUSES = [  # (class, gRPC status, HTTP status)
    (SplitserveError, grpc.StatusCode.INTERNAL, 500),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (NoFreeBlocksError, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE, 503),
    (NoInstanceError, grpc.StatusCode.UNAVAILABLE, 503),
    (EngineLoopStopped, grpc.StatusCode.UNAVAILABLE, 503),
    (TransferError, grpc.StatusCode.UNAVAILABLE, 503),
    (PeerGoneError, grpc.StatusCode.UNAVAILABLE, 503),
    (HandoffNotFoundError, grpc.StatusCode.NOT_FOUND, 404),
    (RankFailure, grpc.StatusCode.UNAVAILABLE, 503),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION, 500),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (RequestCancelledError, grpc.StatusCode.CANCELLED, 499),
    (EngineDroppedRequest, grpc.StatusCode.CANCELLED, 499),
    (ClientAborted, grpc.StatusCode.CANCELLED, 499),
]


def _subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))}


@pytest.mark.parametrize(("cls", "code", "http"), STATUSES)
def test_each_class_carries_its_statuses(cls: type[SplitserveError], code: grpc.StatusCode,
                                         http: int):
    exc = cls("what went wrong")
    assert (exc.grpc_status, exc.http_status) == (code.name, http)
    assert status_of(exc) == (code, "what went wrong")


def test_every_class_is_listed_and_answers_http_as_its_grpc_status_would():
    """A domain error raised in a service reaches the gateway as its gRPC status: the HTTP
    answer must be the same as for the error raised in the gateway itself."""
    assert _subclasses(SplitserveError) - {ServiceError} == {c for c, _, _ in STATUSES[1:]}
    for cls, _, _ in STATUSES:
        assert cls.http_status == errors.http_status_of(cls.grpc_status)
        assert cls.grpc_status in grpc.StatusCode.__members__


def test_classes_keep_the_builtin_bases_callers_catch():
    assert issubclass(InvalidRequestError, ValueError)  # pydantic validators rely on it
    assert issubclass(NoFreeBlocksError, RuntimeError)
    assert issubclass(TransferError, RuntimeError)
    assert issubclass(EngineLoopStopped, RuntimeError)
    assert issubclass(NoInstanceError, LookupError)
    assert issubclass(DeadlineExceededError, TimeoutError)


def test_service_error_takes_its_status_at_raise_time():
    exc = ServiceError(grpc.StatusCode.ALREADY_EXISTS, "request_id 'r' is already in flight")
    assert (exc.grpc_status, exc.http_status) == ("ALREADY_EXISTS", 409)
    assert status_of(exc) == (grpc.StatusCode.ALREADY_EXISTS, "request_id 'r' is already in flight")
    assert ServiceError(grpc.StatusCode.PERMISSION_DENIED, "no").http_status == 500
    assert status_of(ServiceError(grpc.StatusCode.NOT_FOUND, "")) == (
        grpc.StatusCode.NOT_FOUND, "NOT_FOUND")


def test_status_of_keeps_the_non_domain_mappings():
    rpc = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                               grpc.aio.Metadata(), details="the pool is full")
    assert status_of(rpc) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "the pool is full")
    assert status_of(TimeoutError()) == (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    code, details = status_of(redis.ConnectionError("refused"))
    assert code == grpc.StatusCode.UNAVAILABLE and "registry is unreachable" in details
    assert status_of(DecodeError("truncated")) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                   "malformed request: truncated")
    assert status_of(KeyError("x")) == (grpc.StatusCode.INTERNAL, "KeyError: 'x'")
    assert status_of(ValueError("not a domain error"))[0] == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("module", ["common.errors", "common.serving.grpc_util"])
def test_imports_neither_torch_nor_the_engine(module: str):
    code = (f"import sys, {module}; assert 'torch' not in sys.modules, 'torch'; "
            "assert not any(m.startswith('common.engine') for m in sys.modules), "
            "[m for m in sys.modules if m.startswith('common.engine')]")
    if module == "common.errors":
        code += "; assert 'grpc' not in sys.modules, 'grpc'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_engine_policy_imports_no_grpc():
    code = ("import sys, common.engine.core.block_manager, common.engine.core.sampling_params; "
            "assert 'grpc' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)

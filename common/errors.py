"""Every domain error splitserve raises, each carrying the status a client sees for it.

A class names its gRPC status (`grpc_status`, a `grpc.StatusCode` name, so this module imports no
grpc and the engine's policy can raise these without it) and its HTTP status (`http_status`).
`grpc_util.status_of` and the gateway's HTTP API read the two attributes; nothing else maps a
domain error to a status. An error of a status that has no class of its own is a ServiceError,
whose status is chosen where it is raised.

    SplitserveError                     INTERNAL            500
    ├── InvalidRequestError             INVALID_ARGUMENT    400   (also a ValueError)
    ├── OverloadedError                 RESOURCE_EXHAUSTED  429
    │   └── NoFreeBlocksError                                     (also a RuntimeError)
    ├── UnavailableError                UNAVAILABLE         503
    │   ├── NoInstanceError                                       (also a LookupError)
    │   ├── EngineLoopStopped                                     (also a RuntimeError)
    │   ├── TransferError                                         (also a RuntimeError)
    │   └── RankFailure                                           (also a RuntimeError)
    ├── DeadlineExceededError           DEADLINE_EXCEEDED   504   (also a TimeoutError)
    ├── RequestCancelledError           CANCELLED           499
    │   ├── EngineDroppedRequest
    │   └── ClientAborted
    ├── ConfigError                     FAILED_PRECONDITION 500   (also a ValueError)
    └── ServiceError                    chosen at raise time

A class's HTTP status is the one HTTP_STATUS gives its gRPC status, so an error answers the same
whether the gateway raised it or an internal call carried its gRPC status back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

# The HTTP status of a gRPC status (by name); any other is 500.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}


def http_status_of(grpc_status: str) -> int:
    """The HTTP status for a gRPC status name."""
    return HTTP_STATUS.get(grpc_status, 500)


class SplitserveError(Exception):
    """A domain error; its class (or, for ServiceError, its constructor) sets the statuses."""

    grpc_status: str = "INTERNAL"
    http_status: int = 500

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


class InvalidRequestError(SplitserveError, ValueError):
    """A request the gateway or the engine refuses (bad settings, an empty or too long prompt,
    a token id outside the vocabulary); the message says what to change."""

    grpc_status, http_status = "INVALID_ARGUMENT", 400


class OverloadedError(SplitserveError):
    """Refused for want of capacity (the gateway's --max-inflight); the client may retry later."""

    grpc_status, http_status = "RESOURCE_EXHAUSTED", 429


class NoFreeBlocksError(OverloadedError, RuntimeError):
    """The block pool cannot satisfy an allocation (the scheduler preempts or queues instead)."""


class UnavailableError(SplitserveError):
    """A part the request needs is not there now; the gateway resumes the request elsewhere."""

    grpc_status, http_status = "UNAVAILABLE", 503


class NoInstanceError(UnavailableError, LookupError):
    """The router finds no live instance of the needed kind."""


class EngineLoopStopped(UnavailableError, RuntimeError):
    """A command was submitted to an EngineLoop after stop() (the service is shutting down)."""


class TransferError(UnavailableError, RuntimeError):
    """A KV pull failed (unreachable source, timeout, geometry or checksum mismatch); the
    receiver's reserved blocks hold garbage and the caller frees them (kv_transport/base.py)."""


class PeerGoneError(UnavailableError):
    """The prefill instance whose KV a decode service's reservation waits for left the registry
    (its heartbeat lease ran out); the reservation is freed and the gateway resumes the request."""


class HandoffNotFoundError(SplitserveError, LookupError):
    """A prefill service delivered the KV of a request that no Decode call waits for (it was
    cancelled, or never came); the prefill side releases its blocks."""

    grpc_status, http_status = "NOT_FOUND", 404


class DeadlineExceededError(SplitserveError, TimeoutError):
    """The request's deadline (the client's, or --request-timeout-s) passed."""

    grpc_status, http_status = "DEADLINE_EXCEEDED", 504


class RequestCancelledError(SplitserveError):
    """The request ended before its last token because someone called it off."""

    grpc_status, http_status = "CANCELLED", 499


class EngineDroppedRequest(RequestCancelledError):
    """Given to a request's sink in a prefill or decode service when its EngineLoop drops it:
    EngineLoop.abort() (the gRPC call ended, or Abort was called) or the loop stopping. The
    request's blocks are already freed."""


class ClientAborted(RequestCancelledError):
    """Raised in the gateway's relay when the client called GenerationService.Abort for the request;
    the relay ends the client's stream with FINISH_REASON_ABORT and aborts it on each service."""


class ServiceError(SplitserveError):
    """An error whose status is chosen where it is raised:
    `ServiceError(grpc.StatusCode.ALREADY_EXISTS, "...")`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.grpc_status = code.name
        self.http_status = http_status_of(code.name)


class ConfigError(SplitserveError, ValueError):
    """Settings that cannot work together, found at start-up (a tensor parallel size that does
    not divide the model's heads or vocabulary); the message names the numbers."""

    grpc_status, http_status = "FAILED_PRECONDITION", 500


class RankFailure(UnavailableError, RuntimeError):
    """A tensor-parallel rank died, hung past its collective timeout or failed to start: the
    engine cannot step again, and its instance goes down."""

"""Every error the conductor answers with, and the one table mapping it to HTTP and gRPC.

The body is vLLM's OpenAI error object: `{"error": {"message", "type", "param", "code"}}`
with `code` the HTTP status (an int, as vLLM sends it).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


class ConductorError(Exception):
    """Base: carries an OpenAI error `type`, an optional offending `param`, and a `code`
    naming the cause for logs and metrics (the body's `code` is always the HTTP status)."""

    type: str = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


class InvalidRequest(ConductorError):
    type = "BadRequestError"


class PayloadTooLarge(ConductorError):
    type = "RequestEntityTooLargeError"


class Unauthorized(ConductorError):
    type = "AuthenticationError"


class ModelNotFound(ConductorError):
    type = "NotFoundError"


class RequestTimeout(ConductorError):
    """The client did not send its request in time (408)."""

    type = "RequestTimeoutError"


class Overloaded(ConductorError):
    """The scheduler predicts no pair meets the SLOs: come back later (429)."""

    type = "RateLimitError"


class NoCapacity(ConductorError):
    """No healthy instance can take the request (503)."""

    type = "ServiceUnavailableError"


class UpstreamFailed(ConductorError):
    """A worker failed the request in a way no retry could mend (502)."""

    type = "BadGatewayError"


class Timeout(ConductorError):
    type = "TimeoutError"


class ControlUnavailable(ConductorError):
    """A change of the control state could not be stored (etcd unreachable, or the record
    kept changing under it): nothing changed, here or anywhere (503, gRPC UNAVAILABLE)."""

    type = "ServiceUnavailableError"


@dataclass(frozen=True)
class Mapping:
    http: int
    grpc: grpc.StatusCode


ERROR_TABLE: dict[type[ConductorError], Mapping] = {
    InvalidRequest: Mapping(400, grpc.StatusCode.INVALID_ARGUMENT),
    Unauthorized: Mapping(401, grpc.StatusCode.UNAUTHENTICATED),
    ModelNotFound: Mapping(404, grpc.StatusCode.NOT_FOUND),
    RequestTimeout: Mapping(408, grpc.StatusCode.DEADLINE_EXCEEDED),
    PayloadTooLarge: Mapping(413, grpc.StatusCode.INVALID_ARGUMENT),
    Overloaded: Mapping(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    UpstreamFailed: Mapping(502, grpc.StatusCode.UNAVAILABLE),
    NoCapacity: Mapping(503, grpc.StatusCode.UNAVAILABLE),
    ControlUnavailable: Mapping(503, grpc.StatusCode.UNAVAILABLE),
    Timeout: Mapping(504, grpc.StatusCode.DEADLINE_EXCEEDED),
    ConductorError: Mapping(500, grpc.StatusCode.INTERNAL),
}

WORKER_STATUS: dict[grpc.StatusCode, type[ConductorError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
}
"""A worker's gRPC failure as the conductor's error (the table's inverse); others are 502."""


def mapping(err: ConductorError) -> Mapping:
    for cls in type(err).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]  # type: ignore[index]
    return ERROR_TABLE[ConductorError]


def http_status(err: ConductorError) -> int:
    return mapping(err).http


def from_worker_status(code: grpc.StatusCode, details: str) -> ConductorError:
    cls = WORKER_STATUS.get(code, UpstreamFailed)
    if cls is UpstreamFailed:
        return UpstreamFailed(f"worker failed ({code.name}): {details}")
    return cls(details, retry_after=1.0 if cls is Overloaded else None)


def error_payload(message: str, err_type: str, status: int, param: str | None = None) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_body(err: ConductorError) -> dict:
    return error_payload(err.message, err.type, http_status(err), err.param)

"""Every error the conductor answers with, and the one table mapping it to HTTP and gRPC."""

from __future__ import annotations

from dataclasses import dataclass

import grpc


class ConductorError(Exception):
    """Base: carries an OpenAI error `type`, an optional offending `param` and `code`."""

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


class ModelNotFound(ConductorError):
    type = "NotFoundError"


class Unauthorized(ConductorError):
    type = "AuthenticationError"


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


@dataclass(frozen=True)
class Mapping:
    http: int
    grpc: grpc.StatusCode


ERROR_TABLE: dict[type[ConductorError], Mapping] = {
    InvalidRequest: Mapping(400, grpc.StatusCode.INVALID_ARGUMENT),
    Unauthorized: Mapping(401, grpc.StatusCode.UNAUTHENTICATED),
    ModelNotFound: Mapping(404, grpc.StatusCode.NOT_FOUND),
    Overloaded: Mapping(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    UpstreamFailed: Mapping(502, grpc.StatusCode.UNAVAILABLE),
    NoCapacity: Mapping(503, grpc.StatusCode.UNAVAILABLE),
    Timeout: Mapping(504, grpc.StatusCode.DEADLINE_EXCEEDED),
    ConductorError: Mapping(500, grpc.StatusCode.INTERNAL),
}


def mapping(err: ConductorError) -> Mapping:
    for cls in type(err).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]  # type: ignore[index]
    return ERROR_TABLE[ConductorError]


def from_worker_status(code: grpc.StatusCode, details: str) -> ConductorError:
    """A worker's gRPC failure as the conductor's error (the inverse direction of the table)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Timeout(f"worker deadline exceeded: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(details, retry_after=1.0)
    return UpstreamFailed(f"worker failed ({code.name}): {details}")


def error_body(err: ConductorError) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    status = mapping(err).http
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code if err.code is not None else status}}

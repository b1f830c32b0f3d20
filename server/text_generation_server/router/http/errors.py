"""Errors as each HTTP API shapes them, from the gRPC status the core answers with.

OpenAI: `{"error": {"message", "type", "param", "code"}}` with 400 (bad input), 401 (API key),
403 (run-time adapter loading not opened), 404 (unknown model or path), 413 (body too large),
429 (at capacity), 503 (shutting down).
TGI: `{"error", "error_type"}` with 422 for validation (TGI's status), 429 overloaded, 424 when
generation failed. Client input never gets a 5xx.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass
class HttpError(Exception):
    """An answer other than success. `kind`: OpenAI's error type (TGI's error_type follows from
    it); `param`: the field at fault, where one is."""

    status: int
    message: str
    kind: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param)


# gRPC status of the core -> (HTTP status, OpenAI type)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error"),  # a LoRA adapter's name (vLLM: 400)
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),  # run-time adapter loading not opened
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "service_unavailable"),  # an unload's drain ran out of time
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


def from_status(code: grpc.StatusCode, message: str) -> HttpError:
    status, kind = _STATUS.get(code, (500, "server_error"))
    return HttpError(status, message, kind)


def openai_body(error: HttpError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param,
                      "code": error.code if error.code is not None else str(error.status)}}


# OpenAI type -> TGI's error_type and status (TGI answers validation errors with 422)
_TGI = {
    "invalid_request_error": ("validation", 422),
    "rate_limit_error": ("overloaded", 429),
    "service_unavailable": ("unavailable", 503),
    "authentication_error": ("authentication", 401),
    "permission_error": ("authentication", 403),
    "not_found_error": ("not_found", 404),
    "request_too_large": ("validation", 413),
    "server_error": ("generation", 424),
}


def tgi_status_and_body(error: HttpError) -> tuple[int, dict]:
    error_type, status = _TGI.get(error.kind, ("generation", error.status))
    if error.status in (404, 405, 413):  # the transport's answers keep their status
        status = error.status
    return status, {"error": error.message, "error_type": error_type}

"""OpenAI-shaped errors: ``{"error": {"message", "type", "code"}}`` with the right HTTP status.

Handlers turn APIError, request validation failures and stray HTTP errors into that shape; the
mapping from engine exceptions to statuses lives in :func:`api_error_from`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters import AdapterCapacityError, AdapterError, UnknownAdapterError
from lora_runner.entrypoints.openai.redact import redact_paths

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a client told "no capacity" should wait before trying again

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "adapter_load_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
          504: "timeout_error"}


class APIError(Exception):
    """An error answered to the client: status, message, OpenAI error code and extra headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def response(self) -> JSONResponse:
        """The JSON response for this error."""
        return JSONResponse(error_body(self.status, self.message, self.code), status_code=self.status,
                            headers=self.headers)


def error_body(status: int, message: str, code: str | None = None) -> dict:
    """The OpenAI error object for a status (absolute server paths in `message` cut to their last part)."""
    kind = _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": redact_paths(message), "type": kind, "code": code}}


def model_not_found(name: str) -> APIError:
    """404 for an unknown model name: the same for names that exist but the caller may not see."""
    return APIError(404, f"The model `{name}` does not exist.", "model_not_found")


def api_error_from(exc: BaseException) -> APIError:
    """Map an engine exception to its status: capacity 503, unknown adapter 404, other adapter
    problems 422, bad argument 400, an engine that stopped 503; anything else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, AdapterCapacityError):
        return APIError(503, f"no adapter capacity: {exc}", "adapter_capacity")
    if isinstance(exc, UnknownAdapterError):
        return APIError(404, str(exc), "model_not_found")
    if isinstance(exc, AdapterError):
        return APIError(422, str(exc), "adapter_load_failed")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), "invalid_value")
    if isinstance(exc, RuntimeError):  # the engine is closed, shut down or its step thread died
        return APIError(503, f"the engine is not serving requests: {exc}", "engine_unavailable")
    logger.error("unexpected error", exc_info=exc)
    return APIError(500, "internal server error", "internal_error")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Render every error the app raises in the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, _validation_message(exc), "invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return api_error_from(exc).response()

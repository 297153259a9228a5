"""The gateway's one error: an OpenAI-shaped answer with its HTTP status. Every module that
checks a request raises it (gateway/requests.py, structured.py, tools.py, service.py)."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        named = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 429: "rate_limit_error", 503: "service_unavailable"}
        return named.get(self.status, "invalid_request_error" if self.status < 500
                         else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)

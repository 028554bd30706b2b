"""The one error of the HTTP service: a request it will not run, and the status it gets."""

from __future__ import annotations

from numaov import NumaovError


class RequestError(NumaovError):
    """A request the service refuses: ``param`` names the field (OpenAI's ``error.param``),
    ``status`` is the HTTP status, ``kind`` OpenAI's ``error.type``, ``code`` its
    ``error.code`` and ``headers`` extra response headers (``Retry-After`` with 429 / 503)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, *,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, parameter=param)
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}

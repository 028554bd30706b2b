"""What every route of the service shares: the route declaration, options, the error shape,
reading a JSON body within its size limit, the key and metrics gate, and waiting for a client
to go away."""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any

from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.lm_requests import ChatOptions, Limits

API_KEY_ENV = "NUMAOV_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a long prompt fits, a runaway upload does not
DEFAULT_MAX_QUEUE = 256
# Paths open without the API key: probes and scrapers do not carry it.
OPEN_PATHS = ("/health", "/metrics")


@dataclass(frozen=True)
class Route:
    """One route of the service, declared once by the routes object that answers it:
    ``handler`` names its method. ``kind``: ``"model"`` (a route that runs a model: listed
    first, and in ``numaov serve``'s start line), ``"info"`` (listed after them) or
    ``"file"`` (a result's content: not listed)."""

    method: str
    path: str
    handler: str
    kind: str = "model"

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


def add_routes(app: Any, routes: Any) -> None:
    """Register every route ``routes`` declares (its ``ROUTES``) on the FastAPI ``app``."""
    for route in routes.ROUTES:
        app.add_api_route(route.path, getattr(routes, route.handler), methods=[route.method])


@dataclass(frozen=True)
class ServiceOptions:
    """The limits and the key of one server, and how it reads chat (``chat``)."""

    api_key: str | None = None
    # Requests waiting for a place (LM: sequences not yet in the batch; video: jobs not yet
    # running) beyond which a new one gets 429.
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: Limits = field(default_factory=Limits)
    chat: ChatOptions = field(default_factory=ChatOptions)


def error_response(error: RequestError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=error.status, content=error.body(), headers=error.headers)


async def read_json(request: Any, max_bytes: int) -> Any:
    """The body as bytes, refused with 413 beyond ``max_bytes`` (by its Content-Length, or
    while it arrives when it has none), then parsed (off the event loop: a large body takes
    time)."""
    from starlette.concurrency import run_in_threadpool

    too_large = RequestError(f"the request body is larger than {max_bytes} bytes; expected at "
                             f"most {max_bytes} (the server's body limit)", None, 413)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)

    def parse(data: bytes) -> Any:
        try:
            return json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            raise RequestError("the request body is not JSON; expected a JSON object") from None

    return await run_in_threadpool(parse, b"".join(chunks))


async def read_model_request(request: Any, max_bytes: int, model_name: str) -> Any:
    """:func:`read_json`, then a 404 when the body names a model other than ``model_name``
    (the one the route serves); a body without ``model`` is for it."""
    body = await read_json(request, max_bytes)
    if isinstance(body, dict) and body.get("model") not in (None, model_name):
        raise RequestError(f"model {body.get('model')!r} is not served here; expected "
                           f"{model_name!r}", "model", 404, code="model_not_found")
    return body


async def wait_for_disconnect(request: Any) -> None:
    """Return once the client has gone away (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Gate:
    """ASGI middleware in front of every route: the API key (401 without it, except on
    ``OPEN_PATHS``) and the request count and latency of every answer, by route."""

    def __init__(self, app: Any, api_key: str | None, metrics: Any, routes: set[str]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics
        self.routes = routes

    def _authorized(self, scope: dict[str, Any]) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                           self.api_key)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        endpoint = scope["path"] if scope["path"] in self.routes else "other"
        status = {"code": 500}

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, sending)
            else:
                response = error_response(RequestError(
                    "this server needs an API key; expected the header 'Authorization: Bearer "
                    "<key>' with the key the server was started with", None, 401,
                    code="invalid_api_key"))
                await response(scope, receive, sending)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

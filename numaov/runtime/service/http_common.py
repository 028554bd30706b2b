"""What every route of the service shares: the route declaration, options, the error shape,
reading a body within its size limit (JSON, or multipart/form-data as OpenAI's video client
sends it), the key and metrics gate, and waiting for a client to go away."""

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
    # POST /v1/videos answers once the video is made (--sync-videos), not at once with a job
    sync_videos: bool = False


def error_response(error: RequestError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=error.status, content=error.body(), headers=error.headers)


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The body's bytes, refused with 413 beyond ``max_bytes``: by its Content-Length before
    any of it is read, or while it arrives when it has none."""
    too_large = RequestError(f"the request body is larger than {max_bytes} bytes; expected at "
                             f"most {max_bytes} (the server's body limit)", None, 413)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer; said so, instead of a traceback
        raise RequestError(f"the client went away after {size} bytes of the body; expected "
                           "the whole body", None, 400) from None
    return b"".join(chunks)


def parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise RequestError("the request body is not JSON; expected a JSON object") from None


def parse_form(data: bytes, content_type: str) -> dict[str, Any]:
    """A multipart/form-data body as an object: text fields as strings, files as bytes, and
    ``name[key]`` fields (how OpenAI's client sends an object) as ``{"name": {"key": ...}}``.
    The parts are cut at the boundary with ``bytes.split`` (a large file costs a copy, not a
    parse); each part's few header lines are read with the standard library's parser."""
    import email.parser
    import email.policy

    expected = ("expected multipart/form-data with one part per field (as OpenAI's client "
                "sends it) or a JSON object")
    header = email.parser.HeaderParser(policy=email.policy.HTTP).parsestr(
        f"Content-Type: {content_type}\r\n\r\n")
    boundary = header.get_param("boundary")
    parts = data.split(b"--" + boundary.encode("latin-1")) if isinstance(boundary, str) else []
    if len(parts) < 2 or not parts[-1].startswith(b"--"):
        raise RequestError(f"the request body is not readable multipart/form-data; {expected}")
    fields: dict[str, Any] = {}
    for part in parts[1:-1]:
        head, found, payload = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not found or not payload.endswith(b"\r\n"):
            raise RequestError(f"a part of the form is cut off; {expected}")
        payload = payload[:-2]
        headers = email.parser.HeaderParser(policy=email.policy.HTTP).parsestr(
            head.decode("latin-1") + "\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise RequestError(f"a part of the form has no field name; {expected}")
        if headers.get_filename() is None:
            try:
                value: Any = payload.decode(headers.get_content_charset() or "utf-8")
            except (LookupError, UnicodeDecodeError):
                raise RequestError(f"form field {name} is not text in its charset; {expected}",
                                   name) from None
        else:
            value = payload  # a file: its bytes
        outer, bracket, inner = name.partition("[")
        if bracket and inner.endswith("]") and "[" not in inner:
            target = fields.setdefault(outer, {})
            if not isinstance(target, dict) or inner[:-1] in target:
                raise RequestError(f"form field {name} is given twice; expected it once", outer)
            target[inner[:-1]] = value
        elif name in fields:
            raise RequestError(f"form field {name} is given twice; expected it once", name)
        else:
            fields[name] = value
    return fields


async def read_json(request: Any, max_bytes: int, form: bool = False) -> Any:
    """The body (:func:`read_body`: 413 beyond ``max_bytes``), parsed off the event loop (a
    large body takes time): JSON, or with ``form`` also multipart/form-data
    (:func:`parse_form`)."""
    from starlette.concurrency import run_in_threadpool

    data = await read_body(request, max_bytes)
    content_type = request.headers.get("content-type", "")
    if form and content_type.lower().startswith("multipart/form-data"):
        return await run_in_threadpool(parse_form, data, content_type)
    return await run_in_threadpool(parse_json, data)


async def read_model_request(request: Any, max_bytes: int, model_name: str,
                             form: bool = False) -> Any:
    """:func:`read_json`, then a 404 when the body names a model other than ``model_name``
    (the one the route serves); a body without ``model`` is for it."""
    body = await read_json(request, max_bytes, form)
    if isinstance(body, dict) and body.get("model") is not None \
            and not isinstance(body["model"], str):
        raise RequestError(f"model is {json.dumps(body['model'])}; expected the model's name, "
                           f"{model_name!r}", "model")
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

"""The FastAPI application: the LM routes, the video routes, models, health, metrics.

Every route is declared once, by the routes object that answers it (``ROUTES``:
:class:`~numaov.runtime.service.lm_routes.LMRoutes`,
:class:`~numaov.runtime.service.video_routes.VideoRoutes`, :class:`CommonRoutes`);
:func:`served_routes` lists them for the errors, the metrics and ``numaov serve``'s start line.
``build_app(...)`` puts :class:`~numaov.runtime.service.http_common.Gate` (the API key and
the request metrics) in front of every route and answers every error in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, unknown paths and methods included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from numaov.runtime.service.chat_template import ChatTemplate
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.http_common import (
    Gate,
    Route,
    ServiceOptions,
    add_routes,
    error_response,
)
from numaov.runtime.service.lm_routes import LMRoutes
from numaov.runtime.service.metrics import ServiceMetrics
from numaov.runtime.service.video_routes import VideoRoutes


@dataclass
class CommonRoutes:
    """What every server answers: the served models, health, the metrics."""

    ROUTES = (Route("GET", "/v1/models", "models", kind="info"),
              Route("GET", "/v1/models/{model}", "model", kind="info"),
              Route("GET", "/health", "health", kind="info"),
              Route("GET", "/metrics", "metrics", kind="info"))

    service: Any  # an LMService, or None
    model_name: str
    video: Any  # a VideoService, or None
    scrape: ServiceMetrics

    def served(self) -> list[dict[str, Any]]:
        out = []
        if self.service is not None:
            out.append({"id": self.model_name, "object": "model", "created": 0,
                        "owned_by": "numaov", "kind": "language-model"})
        if self.video is not None:
            out.append({"id": self.video.model_name, "object": "model", "created": 0,
                        "owned_by": "numaov", "kind": "wan-pipeline"})
        return out

    def models(self) -> Any:
        return {"object": "list", "data": self.served()}

    def model(self, model: str) -> Any:
        """One served model, as OpenAI's ``GET /v1/models/{model}`` answers."""
        for entry in self.served():
            if entry["id"] == model:
                return entry
        names = ", ".join(repr(m["id"]) for m in self.served())
        return error_response(RequestError(f"model {model!r} is not served here; expected "
                                           f"{names}", "model", 404, code="model_not_found"))

    def health(self) -> Any:
        from fastapi.responses import JSONResponse

        service, video = self.service, self.video
        body: dict[str, Any] = {"status": "ok", "models": [m["id"] for m in self.served()]}
        if service is not None:
            state = service.engine.health()
            body.update({
                "model": self.model_name, "ranks": service.world_size,
                "backend": service.backend,
                "lm": {"state": state.state, "restarts": state.restarts,
                       "error": state.failure, "restart_in_s": state.restart_in_s,
                       "failures": [{"time": t, "error": e} for t, e in state.failures],
                       "workers": [{**w, "state": "running" if w["alive"] and state.state
                                    == "ok" else state.state if w["alive"] else "dead",
                                    "restarts": state.restarts} for w in state.workers]}})
            if state.state != "ok":
                body["status"] = state.state
                body["error"] = state.failure
        if video is not None:
            body["video"] = video.health()
            if body["video"]["state"] != "ok" and body["status"] == "ok":
                body["status"] = body["video"]["state"]
        return JSONResponse(status_code=200 if body["status"] == "ok" else 503, content=body)

    def metrics(self) -> Any:
        from fastapi.responses import Response

        data, kind = self.scrape.render()
        return Response(content=data, media_type=kind)


def served_routes(lm: bool, video: bool) -> list[Route]:
    """The routes a server with an LM (``lm``) and a Wan pipeline (``video``) lists: the
    model routes, then the others (a result's content, ``kind`` "file", is not listed)."""
    routes = [*(LMRoutes.ROUTES if lm else ()), *(VideoRoutes.ROUTES if video else ())]
    return ([r for r in routes if r.kind == "model"] + list(CommonRoutes.ROUTES)
            + [r for r in routes if r.kind == "info"])


def build_app(service: Any = None, model_name: str = "", tokenizer: Any = None, *,
              template: ChatTemplate | None = None, options: ServiceOptions | None = None,
              video: Any = None) -> Any:
    """The application serving ``service`` (an :class:`~numaov.runtime.service.lm_service.LMService`,
    or None) under ``model_name`` and ``video`` (a
    :class:`~numaov.runtime.service.video_service.VideoService`, or None)."""
    from fastapi import FastAPI
    from starlette.exceptions import HTTPException as StarletteHTTPException

    options = options or ServiceOptions()
    engine = service.engine if service is not None else None
    metrics = ServiceMetrics(engine, video.queue_depth if video is not None else None)
    app = FastAPI(title="numaov", version="1")
    app.router.redirect_slashes = False  # "/v1/completions/" is an error, not a redirect
    listed = [str(r) for r in served_routes(service is not None, video is not None)]
    listing = ", ".join(listed[:-1]) + " and " + listed[-1]

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        # Unknown paths and methods, in the same error shape as everything else.
        return error_response(RequestError(
            f"{request.method} {request.url.path}: {exc.detail}; this server answers "
            f"{listing}", None, exc.status_code))  # OpenAI's type for these too

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> Any:
        return error_response(exc)

    add_routes(app, CommonRoutes(service, model_name, video, metrics))
    if service is not None:
        add_routes(app, LMRoutes(engine, model_name, tokenizer, template or ChatTemplate(None),
                                 options, metrics, service.failure))
    if video is not None:
        add_routes(app, VideoRoutes(video, options, metrics))
    known = {r.path for r in served_routes(service is not None, video is not None)}
    return Gate(app, options.api_key, metrics, known)

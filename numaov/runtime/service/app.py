"""The FastAPI application: the LM routes, the video routes, models, health, stats, metrics.

``build_app(...)`` puts :class:`~numaov.runtime.service.http_common.Gate` (the API key and
the request metrics) in front of every route and answers every error in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, unknown paths and methods included.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from numaov.runtime.service.chat_template import ChatTemplate
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.http_common import Gate, ServiceOptions, error_response
from numaov.runtime.service.lm_routes import CHAT, COMPLETIONS, LMRoutes
from numaov.runtime.service.metrics import ServiceMetrics


def build_app(service: Any = None, model_name: str = "", tokenizer: Any = None, *,
              template: ChatTemplate | None = None, options: ServiceOptions | None = None,
              video: Any = None) -> Any:
    """The application serving ``service`` (an :class:`~numaov.runtime.service.lm_service.LMService`,
    or None) under ``model_name`` and ``video`` (a
    :class:`~numaov.runtime.service.video_routes.VideoService`, or None)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    options = options or ServiceOptions()
    engine = service.engine if service is not None else None
    metrics = ServiceMetrics(engine, video.queue_depth if video is not None else None)
    app = FastAPI(title="numaov", version="1")
    app.router.redirect_slashes = False  # "/v1/completions/" is an error, not a redirect
    routes = ["GET /v1/models", "GET /health", "GET /metrics"]
    if service is not None:
        routes = [f"POST {COMPLETIONS}", f"POST {CHAT}", *routes, "GET /stats"]
    if video is not None:
        routes = [*(f"POST {p}" for p in video.paths), *routes]
    listing = ", ".join(routes[:-1]) + " and " + routes[-1]

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        # Unknown paths and methods, in the same error shape as everything else.
        return error_response(RequestError(
            f"{request.method} {request.url.path}: {exc.detail}; this server answers "
            f"{listing}", None, exc.status_code,
            kind="not_found" if exc.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> Any:
        return error_response(exc)

    def served() -> list[dict[str, Any]]:
        out = []
        if service is not None:
            out.append({"id": model_name, "object": "model", "created": 0,
                        "owned_by": "numaov", "kind": "language-model"})
        if video is not None:
            out.append({"id": video.model_name, "object": "model", "created": 0,
                        "owned_by": "numaov", "kind": "wan-pipeline"})
        return out

    @app.get("/v1/models")
    def models() -> Any:
        return {"object": "list", "data": served()}

    @app.get("/health")
    def health() -> Any:
        body: dict[str, Any] = {"status": "ok", "models": [m["id"] for m in served()]}
        if service is not None:
            state = engine.health()
            body.update({
                "model": model_name, "ranks": service.world_size, "backend": service.backend,
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

    @app.get("/metrics")
    def scrape() -> Any:
        data, kind = metrics.render()
        return Response(content=data, media_type=kind)

    if service is not None:
        lm = LMRoutes(engine, model_name, tokenizer, template or ChatTemplate(None), options,
                      metrics, service.failure)

        @app.get("/stats")
        def stats() -> Any:
            return engine.stats().as_dict()

        @app.post(COMPLETIONS)
        async def completions(request: Request) -> Any:
            return await lm.answer(request, chat=False)

        @app.post(CHAT)
        async def chat(request: Request) -> Any:
            return await lm.answer(request, chat=True)

    if video is not None:
        video.add_routes(app, options, metrics)

    known = {"/v1/models", "/health", "/metrics", "/stats", COMPLETIONS, CHAT,
             *(video.paths if video is not None else ())}
    return Gate(app, options.api_key, metrics, known)

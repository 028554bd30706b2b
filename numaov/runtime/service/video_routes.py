"""Images and videos from an exported Wan text-to-video pipeline, OpenAI-shaped.

- ``POST /v1/images/generations`` (OpenAI's images API): ``prompt``, ``n`` (1 to 4),
  ``size`` ("WxH"), ``response_format`` ("b64_json", the default, or "url"), and numaov's
  ``negative_prompt``, ``seed``, ``steps``, ``guidance``: one frame per image, as PNG.
- ``POST /v1/videos`` (after OpenAI's video API, whose ``POST /v1/videos`` takes ``prompt``,
  ``size`` and ``seconds`` and answers a ``video`` object, with the file at
  ``GET /v1/videos/{id}/content``): ``prompt``, ``size``, ``frames`` (4k+1, Wan's VAE) or
  ``seconds`` (at 16 frames/s, rounded to the nearest 4k+1 frames), ``format`` ("mp4", the
  default, or "webp": animated), ``n``, ``response_format``, ``negative_prompt``, ``seed``,
  ``steps``, ``guidance``, and ``input_reference``: the first frame for image-to-video (Wan
  2.2 TI2V and I2V exports), a PNG, JPEG or WebP image of the video's size as base64 or a
  ``data:image/...;base64,`` URL (OpenAI's video API uploads the same field as a file; this
  service takes JSON bodies only). It answers once the videos are made (no polling needed): a
  ``video`` object with ``status`` "completed" and ``data`` (base64 or URL per video).
- ``GET /v1/videos/{id}/content`` and ``GET /v1/images/{id}/content``: a result's file, kept
  for the server's life (the last ``KEPT_RESULTS``); the ``url`` answers point there.

Each route parses the body (:mod:`~numaov.runtime.service.video_requests`), hands the job
to the :class:`~numaov.runtime.service.video_service.VideoService` (429 beyond ``--max-queue``
waiting) and shapes its answer.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from numaov import NumaovError
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.http_common import (
    Route,
    ServiceOptions,
    error_response,
    read_model_request,
)
from numaov.runtime.service.metrics import ServiceMetrics
from numaov.runtime.service.video_requests import (
    IMAGE_FIELDS,
    VIDEO_FIELDS,
    check_video_job,
    parse_video_job,
)
from numaov.runtime.service.video_service import KEPT_RESULTS, VideoService
from numaov.runtime.wan.video_output import DEFAULT_FPS

IMAGES = "/v1/images/generations"
VIDEOS = "/v1/videos"
# The pipeline's own checks (NumaovError.parameter) as the request's fields.
_PARAMS = {"image": "input_reference", "prompt": "prompt", "negative_prompt": "negative_prompt",
           "frames": "frames", "steps": "steps"}


@dataclass
class VideoRoutes:
    """The pipeline's routes and the state they share."""

    ROUTES = (Route("POST", IMAGES, "images"), Route("POST", VIDEOS, "videos"),
              Route("GET", "/v1/videos/{key}/content", "content", kind="file"),
              Route("GET", "/v1/images/{key}/content", "content", kind="file"))

    service: VideoService
    options: ServiceOptions
    metrics: ServiceMetrics

    async def answer(self, request: Request, video: bool) -> Any:
        from fastapi.responses import JSONResponse

        service = self.service
        endpoint = VIDEOS if video else IMAGES
        try:
            body = await read_model_request(request, self.options.max_body_bytes,
                                            service.model_name)
            job = parse_video_job(body, video, service.limits,
                                  VIDEO_FIELDS if video else IMAGE_FIELDS)
            job = check_video_job(job, service.pipeline, service.model_name, video)
            waiting = service.admit(job, self.options.max_queue)
            if waiting is not None:
                raise RequestError(
                    f"the queue is full ({waiting} generations waiting, at most "
                    f"{self.options.max_queue}); expected a retry later", None, 429,
                    kind="rate_limit_error", headers={"Retry-After": "5"})
        except RequestError as exc:
            self.metrics.video_jobs.labels(endpoint, str(exc.status)).inc()
            return error_response(exc)
        try:
            outputs = await service.generate(job)
        except NumaovError as exc:  # the pipeline's own checks: sizes, prompt length
            self.metrics.video_jobs.labels(endpoint, "400").inc()
            return error_response(RequestError(str(exc), _PARAMS.get(exc.parameter, "size")))
        except Exception as exc:  # noqa: BLE001 - the server stays up; health shows it
            self.metrics.video_jobs.labels(endpoint, "500").inc()
            return error_response(RequestError(f"generation failed: {exc}", None, 500,
                                               kind="server_error"))
        self.metrics.video_jobs.labels(endpoint, "200").inc()
        base = str(request.base_url).rstrip("/")
        data = []
        for content, media in outputs:
            if job.as_url:
                kind = "videos" if video else "images"
                data.append({"url": f"{base}/v1/{kind}/{service.keep(content, media)}/content"})
            else:
                data.append({"b64_json": base64.b64encode(content).decode("ascii")})
        created = int(time.time())
        if not video:
            return JSONResponse({"created": created, "data": data})
        return JSONResponse({
            "id": f"video_{uuid.uuid4().hex}", "object": "video", "status": "completed",
            "created_at": created, "completed_at": int(time.time()),
            "model": service.model_name, "size": f"{job.width}x{job.height}",
            "frames": job.frames, "seconds": f"{(job.frames - 1) / DEFAULT_FPS:g}",
            "format": job.format, "seed": job.seeds[0], "progress": 100, "data": data})

    # -- the routes -------------------------------------------------------------------------

    async def images(self, request: Request) -> Any:
        return await self.answer(request, video=False)

    async def videos(self, request: Request) -> Any:
        return await self.answer(request, video=True)

    def content(self, key: str) -> Any:
        from fastapi.responses import Response

        found = self.service.result(key)
        if found is None:
            return error_response(RequestError(
                f"no result {key!r}; expected the id of one of the last {KEPT_RESULTS} "
                "results", None, 404, kind="not_found"))
        return Response(content=found[0], media_type=found[1])

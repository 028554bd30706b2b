"""Images and videos from an exported Wan pipeline, OpenAI-shaped.

- ``POST /v1/images/generations`` (OpenAI's images API): ``prompt``, ``n`` (1 to 4),
  ``size`` ("WxH"), ``response_format`` ("b64_json", the default, or "url"), and numaov's
  ``negative_prompt``, ``seed``, ``steps``, ``guidance``: one frame per image, as PNG. It
  answers once the images are made; a client that goes away cancels them.
- ``POST /v1/videos`` (OpenAI's video API: a JSON body, or multipart/form-data as OpenAI's
  client sends it): ``prompt``, ``size``, ``frames`` (4k+1, Wan's VAE) or ``seconds`` (at 16
  frames/s, rounded to the nearest 4k+1 frames), ``format`` ("mp4", the default, or "webp":
  animated), ``negative_prompt``, ``seed``, ``steps``, ``guidance``, and ``input_reference``:
  the first frame for image-to-video (Wan 2.2 TI2V and I2V exports), a PNG, JPEG or WebP
  image of the video's size, as a file (form), base64, a ``data:image/...;base64,`` URL or
  ``{"image_url": ...}``. It answers at once with a ``video`` object (``status`` "queued");
  then ``GET /v1/videos/{video_id}`` polls it (``in_progress`` with ``progress`` in percent,
  then ``completed`` or ``failed`` with ``error``), ``GET /v1/videos/{video_id}/content``
  downloads the file (``variant`` "video", the default, or "thumbnail": the first frame as
  PNG), ``GET /v1/videos`` lists the jobs (``limit``, ``after``, ``order``, as OpenAI's lists)
  and ``DELETE /v1/videos/{video_id}`` cancels a queued or running job (its memory is free
  when the answer comes) or drops a finished one's file. With ``--sync-videos``
  (``ServiceOptions.sync_videos``) ``POST /v1/videos`` instead answers once the videos are
  made, as the images route does, with ``n`` and ``response_format`` and the videos in
  ``data``.
- ``GET /v1/images/{image_id}/content``: an image answered as a URL (``index``: which of the
  ``n``; the same for a synchronous video's ``n``).

Each route reads the body (413 above ``--max-body-bytes``, before parsing) and, off the
event loop, checks it (:mod:`~numaov.runtime.service.video_requests`, ``input_reference``
decoded) and hands the job to the
:class:`~numaov.runtime.service.video_service.VideoService` (429 beyond ``--max-queue``
waiting, 400 above the memory budget).
"""

from __future__ import annotations

import asyncio
import base64
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
    wait_for_disconnect,
)
from numaov.runtime.service.metrics import ServiceMetrics
from numaov.runtime.service.video_requests import (
    ASCII_DIGITS,
    IMAGE_FIELDS,
    SYNC_VIDEO_FIELDS,
    VIDEO_FIELDS,
    check_video_job,
    form_values,
    parse_video_job,
)
from numaov.runtime.service.video_service import (
    COMPLETED,
    FAILED,
    Generation,
    VideoService,
)
from numaov.runtime.wan.video_output import DEFAULT_FPS

IMAGES = "/v1/images/generations"
VIDEOS = "/v1/videos"
VIDEO = "/v1/videos/{video_id}"
# The pipeline's own checks (NumaovError.parameter) as the request's fields.
_PARAMS = {"image": "input_reference", "prompt": "prompt", "negative_prompt": "negative_prompt",
           "frames": "frames", "steps": "steps", "guidance": "guidance", "sampler": "scheduler",
           "scheduler": "scheduler", "shift": "shift", "cache": "cache"}
LIST_LIMIT, MAX_LIST_LIMIT = 20, 100  # OpenAI's list endpoints: 20 by default, 100 at most
VARIANTS = ("video", "thumbnail")


def _param(parameter: str | None) -> str:
    return _PARAMS.get(parameter or "", "size")


@dataclass
class VideoRoutes:
    """The pipeline's routes and the state they share."""

    ROUTES = (Route("POST", IMAGES, "images"), Route("POST", VIDEOS, "create_video"),
              Route("GET", VIDEOS, "list_videos", kind="info"),
              Route("GET", VIDEO, "retrieve_video", kind="info"),
              Route("DELETE", VIDEO, "delete_video", kind="info"),
              Route("GET", VIDEO + "/content", "video_content", kind="file"),
              Route("GET", "/v1/images/{image_id}/content", "image_content", kind="file"))

    service: VideoService
    options: ServiceOptions
    metrics: ServiceMetrics

    def __post_init__(self) -> None:
        self.service.on_finish = self.count

    def count(self, generation: Generation) -> None:
        """A finished generation in the metrics: "completed", or its failure's code."""
        outcome = (COMPLETED if generation.status == COMPLETED
                   else (generation.error or {}).get("code", FAILED))
        self.metrics.video_jobs.labels(VIDEOS if generation.kind == "video" else IMAGES,
                                       outcome).inc()

    # -- creating -------------------------------------------------------------------------

    async def admit(self, request: Request, video: bool, keep: bool | None) -> Generation:
        """The body read, checked and queued as a generation (every refusal a
        :class:`RequestError`); ``keep`` None: kept when it answers with URLs."""
        from starlette.concurrency import run_in_threadpool

        service = self.service
        body = await read_model_request(request, self.options.max_body_bytes,
                                        service.model_name, form=video)
        fields = (IMAGE_FIELDS if not video else
                  SYNC_VIDEO_FIELDS if self.options.sync_videos else VIDEO_FIELDS)

        def check() -> Generation:  # decodes base64 and the image, estimates: off the loop
            job = parse_video_job(form_values(body), video, service.limits, fields)
            job = check_video_job(job, service.pipeline, service.model_name, video)
            try:
                return service.create(job, "video" if video else "image",
                                      self.options.max_queue,
                                      keep=job.as_url if keep is None else keep)
            except RequestError:
                raise
            except NumaovError as exc:  # the pipeline's own checks: sizes, frames
                raise RequestError(str(exc), _param(exc.parameter)) from None

        return await run_in_threadpool(check)

    def refused(self, endpoint: str, exc: RequestError) -> Any:
        self.metrics.video_jobs.labels(endpoint, str(exc.status)).inc()
        return error_response(exc)

    async def generate_now(self, request: Request, video: bool) -> Any:
        """The synchronous answer: once every choice is made; a client that goes away cancels
        the job."""
        from fastapi.responses import JSONResponse

        endpoint = VIDEOS if video else IMAGES
        try:
            generation = await self.admit(request, video, keep=None)
        except RequestError as exc:
            return self.refused(endpoint, exc)
        done = asyncio.ensure_future(self.service.wait(generation))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # the client went away, or the server stops: nothing is left running
            # No await here: a cancelled answer could be cancelled again at it, before the
            # job is. The dispatcher kills the worker within its poll interval.
            gone.cancel()
            if not done.done():
                done.cancel()
                self.service.cancel(generation.id)
        if not done.done() or done.cancelled():
            return None
        if not generation.keep:
            self.service.discard(generation.id)
        if generation.status == FAILED:
            return error_response(self.failure(generation))
        base = str(request.base_url).rstrip("/")
        kind = "videos" if video else "images"
        data = []
        for index, output in enumerate(generation.outputs):
            if generation.keep:
                data.append({"url": f"{base}/v1/{kind}/{generation.id}/content"
                             + (f"?index={index}" if index else "")})
            else:
                data.append({"b64_json": base64.b64encode(output.data).decode("ascii")})
        if not video:
            return JSONResponse({"created": generation.created_at, "data": data})
        return JSONResponse({**self.video_object(generation), "data": data})

    @staticmethod
    def failure(generation: Generation) -> RequestError:
        error = generation.error or {}
        param = error.get("param")
        return RequestError(error.get("message", "generation failed"),
                            _param(param) if error.get("code") == "invalid_request" else param,
                            error.get("status", 500), kind=error.get("type", "server_error"),
                            code=error.get("code"))

    def video_object(self, generation: Generation) -> dict[str, Any]:
        """OpenAI's ``video`` object, with numaov's settings beside OpenAI's fields."""
        job = generation.job
        error = None
        if generation.status == FAILED and generation.error is not None:
            failure = self.failure(generation).body()["error"]
            error = {"code": failure["code"], "message": failure["message"],
                     "param": failure["param"], "type": failure["type"]}
        return {
            "id": generation.id, "object": "video", "model": self.service.model_name,
            "status": generation.status, "progress": generation.progress,
            "created_at": generation.created_at, "completed_at": generation.completed_at,
            "expires_at": generation.expires_at, "error": error, "prompt": job.prompt,
            "remixed_from_video_id": None, "size": f"{job.width}x{job.height}",
            "seconds": f"{(job.frames - 1) / DEFAULT_FPS:g}", "frames": job.frames,
            "fps": DEFAULT_FPS, "format": job.format, "seed": job.seeds[0], "steps": job.steps,
            "guidance": job.guidance, "scheduler": job.scheduler, "shift": job.shift,
            "cache": job.cache}

    # -- the routes -----------------------------------------------------------------------

    async def images(self, request: Request) -> Any:
        return await self.generate_now(request, video=False)

    async def create_video(self, request: Request) -> Any:
        if self.options.sync_videos:
            return await self.generate_now(request, video=True)
        try:
            generation = await self.admit(request, video=True, keep=True)
        except RequestError as exc:
            return self.refused(VIDEOS, exc)
        return self.video_object(generation)

    def known(self, video_id: str, kind: str = "video") -> Generation:
        found = self.service.get(video_id)
        if found is None or found.kind != kind:
            limits = self.service.results
            raise RequestError(
                f"no {kind} {video_id!r}; expected the id of a {kind} this server made (a "
                f"finished one is kept for {limits.ttl_s:g} s, {limits.count} and "
                f"{limits.bytes} bytes of files at most, and until it is deleted)", None, 404,
                kind="invalid_request_error", code="not_found")
        return found

    async def retrieve_video(self, video_id: str) -> Any:
        try:
            return self.video_object(self.known(video_id))
        except RequestError as exc:
            return error_response(exc)

    async def delete_video(self, video_id: str) -> Any:
        try:
            self.known(video_id)
        except RequestError as exc:
            return error_response(exc)
        if await self.service.delete(video_id) is None:  # deleted meanwhile by another
            return error_response(RequestError(f"no video {video_id!r}", None, 404,
                                               code="not_found"))
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    async def list_videos(self, request: Request) -> Any:
        try:
            query = _query(request, ("limit", "after", "order"))
            limit = query.get("limit", str(LIST_LIMIT))
            if not ASCII_DIGITS.fullmatch(limit) or not 1 <= int(limit) <= MAX_LIST_LIMIT:
                raise RequestError(f"limit is {limit!r}; expected an integer from 1 to "
                                   f"{MAX_LIST_LIMIT}", "limit")
            order = query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise RequestError(f"order is {order!r}; expected \"asc\" or \"desc\"", "order")
            videos = self.service.listing("video")
            if order == "desc":
                videos.reverse()
            after = query.get("after")
            if after is not None:
                # by creation order: a cursor deleted or expired since its page still places
                cursor = self.service.created_order(after)
                if cursor is None:
                    raise RequestError(f"after is {after!r}, which is not a video this server "
                                       "made; expected the id of the last video of the "
                                       "previous page", "after")
                order_of = self.service.created_order
                videos = [v for v in videos if ((order_of(v.id) or 0) > cursor if order == "asc"
                                                else (order_of(v.id) or 0) < cursor)]
        except RequestError as exc:
            return error_response(exc)
        page = videos[:int(limit)]
        return {"object": "list", "data": [self.video_object(v) for v in page],
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None, "has_more": len(videos) > len(page)}

    async def video_content(self, video_id: str, request: Request) -> Any:
        return self.content(video_id, request, "video")

    async def image_content(self, image_id: str, request: Request) -> Any:
        return self.content(image_id, request, "image")

    def content(self, key: str, request: Request, kind: str) -> Any:
        from fastapi.responses import Response

        try:
            query = _query(request, ("variant", "index") if kind == "video" else ("index",))
            generation = self.known(key, kind)
            if generation.status != COMPLETED:
                what = (f"failed: {(generation.error or {}).get('message')}"
                        if generation.status == FAILED
                        else f"{generation.status} ({generation.progress}%)")
                # 404, as OpenAI answers a video that is not ready yet
                raise RequestError(f"{kind} {key!r} is {what}; expected its content once its "
                                   "status is completed", None, 404, code="not_completed")
            index = query.get("index", "0")
            if not ASCII_DIGITS.fullmatch(index) or int(index) >= len(generation.outputs):
                raise RequestError(f"index is {index!r}; expected 0 to "
                                   f"{len(generation.outputs) - 1}", "index")
            output = generation.outputs[int(index)]
            variant = query.get("variant", "video")
            if variant not in VARIANTS:
                raise RequestError(f"variant is {variant!r}; expected one of "
                                   f"{', '.join(VARIANTS)} (this server makes no spritesheet)",
                                   "variant")
        except RequestError as exc:
            return error_response(exc)
        if variant == "thumbnail":
            return Response(content=output.thumbnail, media_type="image/png")
        return Response(content=output.data, media_type=output.media)


def _query(request: Request, known: tuple[str, ...]) -> dict[str, str]:
    """The query's parameters, refused (400) when one is not among ``known`` or repeated."""
    params = request.query_params
    for name in params:
        if name not in known:
            raise RequestError(f"unknown query parameter {name}; expected only "
                               f"{', '.join(known)}", name)
        if len(params.getlist(name)) > 1:
            raise RequestError(f"query parameter {name} is given twice; expected it once", name)
    return dict(params)

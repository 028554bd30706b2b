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

Each image or video is one :func:`numaov.runtime.wan.pipeline.run_wan_pipeline` call (choice
``j`` with ``seed + j``), run one at a time on the pipeline's own thread: requests queue
(429 beyond ``--max-queue`` waiting), each graph compiled by the first generation that runs it
and kept (``manifest_reader.keep_compiled``). The pipeline runs in the server's process on the
CPUs it may use, shared with the LM's pinned workers when both are served.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import io
import json
import secrets
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from numaov import NumaovError
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.http_common import ServiceOptions, error_response, read_json
from numaov.runtime.wan.video_output import DEFAULT_FPS

IMAGES = "/v1/images/generations"
VIDEOS = "/v1/videos"
KEPT_RESULTS = 64
MAX_IMAGES = 4
FORMATS = {"mp4": ("video/mp4", ".mp4"), "webp": ("image/webp", ".webp")}


@dataclass(frozen=True)
class VideoLimits:
    """What one request may ask for."""

    max_pixels: int = 1280 * 720
    max_frames: int = 129
    max_steps: int = 100
    max_n: int = MAX_IMAGES


@dataclass(frozen=True)
class VideoJob:
    prompt: str
    negative_prompt: str
    width: int
    height: int
    frames: int
    steps: int
    guidance: float
    seeds: list[int]
    format: str  # "png", "mp4" or "webp"
    as_url: bool
    image: bytes | None = None  # input_reference's file (VideoService checks it before queuing)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get_int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None:
        value = default
    if not _is_int(value) or not low <= value <= high:
        raise RequestError(f"{name} is {json.dumps(value)}; expected an integer from {low} to "
                           f"{high}", name)
    return value


def _size(body: dict[str, Any], limits: VideoLimits) -> tuple[int, int]:
    size = body.get("size") or "64x64"
    parts = size.lower().split("x") if isinstance(size, str) else []
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise RequestError(f"size is {json.dumps(size)}; expected \"WIDTHxHEIGHT\" such as "
                           "\"832x480\"", "size")
    width, height = int(parts[0]), int(parts[1])
    if width * height > limits.max_pixels:
        raise RequestError(f"size {width}x{height} is {width * height} pixels; expected at most "
                           f"{limits.max_pixels}", "size")
    return width, height


def _input_reference(value: Any) -> bytes:
    """The file ``input_reference`` carries: base64 (line breaks and other whitespace
    ignored), or a base64 data URL (its scheme and ``;base64`` in any case)."""
    text = value if isinstance(value, str) else None
    if text is not None and text[:5].lower() == "data:":
        header, _, text = text.partition(",")
        if not header.lower().endswith(";base64"):
            text = None
    try:
        data = base64.b64decode("".join(text.split()), validate=True) if text else b""
    except (binascii.Error, ValueError):
        data = b""
    if not data:
        shown = json.dumps(value)[:40]
        raise RequestError(f"input_reference is {shown}; expected a PNG, JPEG or WebP image as "
                           "base64 or a data:image/...;base64, URL", "input_reference")
    return data


def check_input_reference(job: VideoJob) -> None:
    """The reference is an image of the video's size (read from its header; then decoded
    once, so that a corrupt one is refused before it queues)."""
    from numaov.runtime.wan.image_input import ImageInputError, read_image

    try:
        read_image(io.BytesIO(job.image), job.height, job.width, name="input_reference")
    except ImageInputError as exc:
        raise RequestError(str(exc), "input_reference") from None


def parse_video_job(body: Any, video: bool, limits: VideoLimits,
                    fields: tuple[str, ...]) -> VideoJob:
    """A checked image or video body (the pipeline checks the rest: sizes its VAE and patch
    size take, prompt lengths)."""
    if not isinstance(body, dict):
        raise RequestError("the request body is not a JSON object; expected "
                           '{"prompt": "...", "size": "WxH"}')
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}; expected only "
                           f"{', '.join(fields)}", unknown[0])
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError(f"prompt is {json.dumps(prompt)}; expected non-empty text", "prompt")
    negative = body.get("negative_prompt") or ""
    if not isinstance(negative, str):
        raise RequestError(f"negative_prompt is {json.dumps(negative)}; expected text",
                           "negative_prompt")
    width, height = _size(body, limits)
    n = _get_int(body, "n", 1, 1, limits.max_n)
    steps = _get_int(body, "steps", 20, 1, limits.max_steps)
    guidance = body.get("guidance", 5.0)
    if not isinstance(guidance, (int, float)) or isinstance(guidance, bool) or guidance < 1:
        raise RequestError(f"guidance is {json.dumps(guidance)}; expected a number >= 1 (1: no "
                           "guidance; Wan uses 5)", "guidance")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(62)
    elif not _is_int(seed) or not 0 <= seed < 2**62:
        raise RequestError(f"seed is {json.dumps(seed)}; expected an integer in 0 .. 2**62-1",
                           "seed")
    response_format = body.get("response_format") or "b64_json"
    if response_format not in ("b64_json", "url"):
        raise RequestError(f"response_format is {json.dumps(response_format)}; expected "
                           "\"b64_json\" or \"url\"", "response_format")
    frames, kind = 1, "png"
    if video:
        if body.get("frames") is not None and body.get("seconds") is not None:
            raise RequestError("frames and seconds are both set; expected one of them",
                               "seconds")
        if body.get("seconds") is not None:
            seconds = body["seconds"]
            if isinstance(seconds, str) and seconds.replace(".", "", 1).isdigit():
                seconds = float(seconds)  # OpenAI's video API sends seconds as a string
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
                raise RequestError(f"seconds is {json.dumps(body['seconds'])}; expected a "
                                   "positive number", "seconds")
            frames = 4 * max(round(seconds * DEFAULT_FPS / 4), 1) + 1
            if frames > limits.max_frames:
                raise RequestError(f"seconds {seconds} is {frames} frames at {DEFAULT_FPS}/s; "
                                   f"expected at most {limits.max_frames} frames", "seconds")
        else:
            frames = _get_int(body, "frames", 17, 1, limits.max_frames)
            if (frames - 1) % 4:
                raise RequestError(f"frames is {frames}; expected 4k+1 frames (Wan's VAE), "
                                   f"such as {(frames - 1) // 4 * 4 + 1} or "
                                   f"{(frames - 1) // 4 * 4 + 5}", "frames")
        kind = body.get("format") or "mp4"
        if kind not in FORMATS:
            raise RequestError(f"format is {json.dumps(kind)}; expected one of "
                               f"{', '.join(FORMATS)}", "format")
    image = (None if body.get("input_reference") is None
             else _input_reference(body["input_reference"]))
    return VideoJob(prompt, negative, width, height, frames, steps, float(guidance),
                    [(seed + j) % 2**62 for j in range(n)], kind, response_format == "url",
                    image)


IMAGE_FIELDS = ("model", "prompt", "negative_prompt", "n", "size", "response_format", "seed",
                "steps", "guidance", "user", "quality", "style")
VIDEO_FIELDS = ("model", "prompt", "negative_prompt", "n", "size", "response_format", "seed",
                "steps", "guidance", "frames", "seconds", "format", "input_reference", "user")


class VideoService:
    """An exported Wan pipeline served one generation at a time on its own thread."""

    paths = (IMAGES, VIDEOS)

    def __init__(self, model_dir: str | Path, model_name: str, backend: str = "openvino",
                 limits: VideoLimits | None = None) -> None:
        from numaov.runtime.wan.pipeline import read_pipeline

        self.pipeline = read_pipeline(model_dir)  # checked now: a bad export fails at start
        self.model_dir = Path(model_dir)
        self.model_name = model_name
        self.backend = backend
        self.limits = limits or VideoLimits()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="numaov-video")
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._done = 0
        self._failures: collections.deque = collections.deque(maxlen=8)
        self._results: collections.OrderedDict[str, tuple[bytes, str]] = \
            collections.OrderedDict()
        self._scratch = tempfile.TemporaryDirectory(prefix="numaov-video-")
        # Every graph is compiled by the first generation that runs it and kept for the
        # server's life (only the pipeline's thread touches it).
        self._compiled: dict = {}

    def queue_depth(self) -> int:
        with self._lock:
            return self._waiting + self._running

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"state": "ok", "model": self.model_name, "backend": self.backend,
                    "waiting": self._waiting, "running": self._running, "done": self._done,
                    "compiled_graphs": len(self._compiled),
                    "failures": [{"time": t, "error": e} for t, e in self._failures]}

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._scratch.cleanup()

    def __enter__(self) -> VideoService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one generation (on the pipeline's thread) ------------------------------------------

    def _generate(self, job: VideoJob, seed: int) -> tuple[bytes, str]:
        from numaov.runtime.manifest_reader import keep_compiled
        from numaov.runtime.wan.pipeline import run_wan_pipeline
        from numaov.runtime.wan.sampler import WanSampleRequest

        with self._lock:
            self._waiting -= 1
            self._running += 1
        try:
            with keep_compiled(self._compiled):
                request = WanSampleRequest(frames=job.frames, height=job.height, width=job.width,
                                           steps=job.steps, guidance=job.guidance, seed=seed)
                work = Path(tempfile.mkdtemp(dir=self._scratch.name))
                image = None
                if job.image is not None:
                    image = work / "input_reference"
                    image.write_bytes(job.image)
                media, suffix = FORMATS.get(job.format, ("image/png", ""))
                out = work / ("frames" if job.format == "png" else f"video{suffix}")
                run_wan_pipeline(self.model_dir, request, job.prompt, out,
                                 negative_prompt=job.negative_prompt, backend=self.backend,
                                 image=image)
                data = (out / "frame_00000.png" if job.format == "png" else out).read_bytes()
                for path in sorted(work.rglob("*"), reverse=True):
                    path.unlink() if path.is_file() else path.rmdir()
                work.rmdir()
                return data, media
        finally:
            with self._lock:
                self._running -= 1
                self._done += 1

    def _check_conditioning(self, job: VideoJob, video: bool) -> None:
        """An image for an export that cannot take one, or none for one that needs it, is the
        request's error, said before it queues (and without the server's paths); then the
        image itself."""
        from numaov.runtime.wan.pipeline import VAE_ENCODER, VAE_ENCODER_NEXT

        components = self.pipeline.components
        if job.image is not None and VAE_ENCODER not in components:
            raise RequestError(f"input_reference is set, but {self.model_name!r} has no image "
                               "conditioning (a text-to-video export); expected no "
                               "input_reference", "input_reference")
        if (job.image is not None and self.pipeline.condition_channels
                and VAE_ENCODER_NEXT not in components):
            raise RequestError(f"{self.model_name!r} is an image-to-video export without its "
                               f"{VAE_ENCODER_NEXT!r} graph; expected a complete re-export of "
                               "the pipeline directory", "input_reference", 500,
                               kind="server_error")
        if job.image is not None:
            check_input_reference(job)
        if job.image is None and self.pipeline.needs_image:
            where = ("expected input_reference, the video's first frame" if video else
                     "expected POST /v1/videos with input_reference, the video's first frame")
            raise RequestError(f"{self.model_name!r} is image-to-video: {where}",
                               "input_reference")

    def _keep(self, data: bytes, media: str) -> str:
        key = uuid.uuid4().hex
        with self._lock:
            self._results[key] = (data, media)
            while len(self._results) > KEPT_RESULTS:
                self._results.popitem(last=False)
        return key

    # -- the routes -------------------------------------------------------------------------

    def add_routes(self, app: Any, options: ServiceOptions, metrics: Any) -> None:
        from fastapi.responses import JSONResponse, Response

        async def run(request: Request, video: bool) -> Any:
            endpoint = VIDEOS if video else IMAGES
            try:
                body = await read_json(request, options.max_body_bytes)
                if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
                    raise RequestError(f"model {body.get('model')!r} is not served here; "
                                       f"expected {self.model_name!r}", "model", 404,
                                       code="model_not_found")
                job = parse_video_job(body, video, self.limits,
                                      VIDEO_FIELDS if video else IMAGE_FIELDS)
                self._check_conditioning(job, video)
                with self._lock:
                    if self._waiting + len(job.seeds) > options.max_queue:
                        raise RequestError(
                            f"the queue is full ({self._waiting} generations waiting, at most "
                            f"{options.max_queue}); expected a retry later", None, 429,
                            kind="rate_limit_error", headers={"Retry-After": "5"})
                    self._waiting += len(job.seeds)
            except RequestError as exc:
                metrics.video_jobs.labels(endpoint, str(exc.status)).inc()
                return error_response(exc)
            loop = asyncio.get_running_loop()
            futures = [loop.run_in_executor(self._executor, self._generate, job, seed)
                       for seed in job.seeds]
            # every generation runs to its end (each one's count is kept by _generate)
            outputs = await asyncio.gather(*futures, return_exceptions=True)
            try:
                for output in outputs:
                    if isinstance(output, BaseException):
                        raise output
            except NumaovError as exc:  # the pipeline's own checks: sizes, prompt length
                metrics.video_jobs.labels(endpoint, "400").inc()
                param = ("input_reference" if exc.parameter == "image"
                         else exc.parameter if exc.parameter in ("prompt", "negative_prompt",
                                                                 "frames", "steps") else "size")
                return error_response(RequestError(str(exc), param))
            except Exception as exc:  # noqa: BLE001 - the server stays up; health shows it
                with self._lock:
                    self._failures.append((time.time(), str(exc)))
                metrics.video_jobs.labels(endpoint, "500").inc()
                return error_response(RequestError(f"generation failed: {exc}", None, 500,
                                                   kind="server_error"))
            metrics.video_jobs.labels(endpoint, "200").inc()
            base = str(request.base_url).rstrip("/")
            data = []
            for content, media in outputs:
                if job.as_url:
                    key = self._keep(content, media)
                    kind = "videos" if video else "images"
                    data.append({"url": f"{base}/v1/{kind}/{key}/content"})
                else:
                    data.append({"b64_json": base64.b64encode(content).decode("ascii")})
            created = int(time.time())
            if not video:
                return JSONResponse({"created": created, "data": data})
            return JSONResponse({
                "id": f"video_{uuid.uuid4().hex}", "object": "video", "status": "completed",
                "created_at": created, "completed_at": int(time.time()),
                "model": self.model_name, "size": f"{job.width}x{job.height}",
                "frames": job.frames, "seconds": f"{(job.frames - 1) / DEFAULT_FPS:g}",
                "format": job.format, "seed": job.seeds[0], "progress": 100, "data": data})

        @app.post(IMAGES)
        async def images(request: Request) -> Any:
            return await run(request, video=False)

        @app.post(VIDEOS)
        async def videos(request: Request) -> Any:
            return await run(request, video=True)

        def content(key: str) -> Any:
            with self._lock:
                found = self._results.get(key)
            if found is None:
                return error_response(RequestError(
                    f"no result {key!r}; expected the id of one of the last {KEPT_RESULTS} "
                    "results", None, 404, kind="not_found"))
            return Response(content=found[0], media_type=found[1])

        app.get("/v1/videos/{key}/content")(content)
        app.get("/v1/images/{key}/content")(content)

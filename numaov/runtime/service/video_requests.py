"""Image and video bodies (``POST /v1/images/generations``, ``POST /v1/videos``), checked
into a :class:`VideoJob`; then checked against the served export (:func:`check_video_job`:
its image rule, ``input_reference`` decoded once). A body comes as JSON, or for videos as
multipart/form-data (OpenAI's client): :func:`form_values` turns the form's text into the
numbers JSON would carry, and ``input_reference`` may then be the image file itself.

The fields are described in :mod:`numaov.runtime.service.video_routes`. Every refusal is one
:class:`RequestError` naming the field; the pipeline checks the rest when it runs (sizes its
VAE and patch size take, prompt lengths).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from numaov.runtime.service.errors import RequestError
from numaov.runtime.wan.request import SamplerInputError
from numaov.runtime.wan.schedules import check_sampler, check_shift
from numaov.runtime.wan.step_cache import StepCacheSetting
from numaov.runtime.wan.video_output import DEFAULT_FPS

MAX_IMAGES = 4
# A video's format as a request names it: (media type, video_output.encode_video's kind);
# an image is a PNG.
FORMATS = {"mp4": ("video/mp4", ".mp4"), "webp": ("image/webp", ".webp")}
PNG = ("image/png", ".png")


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
    image: bytes | None = None  # input_reference's file
    # input_reference's pixels (check_video_job decodes them once, before the job queues)
    pixels: np.ndarray | None = None
    # the sampler and its flow shift (None: the pipeline scheduler's own), as `run wan`'s
    # --scheduler and --shift: the few-step recipes of distilled LoRAs
    scheduler: str | None = None
    shift: float | None = None
    # the step cache ("first-block:THRESHOLD", "magcache:THRESHOLD", as `run wan --cache`),
    # None for none
    cache: str | None = None

    @property
    def output(self) -> tuple[str, str]:
        """(media type, encode_video kind) of each result."""
        return FORMATS.get(self.format, PNG)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (NaN and the infinities JSON allows are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _shown(value: Any) -> str:
    """``value`` as the request wrote it, for messages (a form's file part by its size)."""
    if isinstance(value, bytes):
        return f"a file of {len(value)} bytes"
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


# ASCII digits only: str.isdigit() takes "²" and other digits int() and float() refuse.
ASCII_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


def _get_int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None:
        value = default
    if not _is_int(value) or not low <= value <= high:
        raise RequestError(f"{name} is {_shown(value)}; expected an integer from {low} to "
                           f"{high}", name)
    return value


def _size(body: dict[str, Any], limits: VideoLimits) -> tuple[int, int]:
    size = body.get("size") or "64x64"
    parts = size.lower().split("x") if isinstance(size, str) else []
    if len(parts) != 2 or not all(ASCII_DIGITS.fullmatch(p) and int(p) > 0 for p in parts):
        raise RequestError(f"size is {_shown(size)}; expected \"WIDTHxHEIGHT\" such as "
                           "\"832x480\"", "size")
    width, height = int(parts[0]), int(parts[1])
    if width * height > limits.max_pixels:
        raise RequestError(f"size {width}x{height} is {width * height} pixels; expected at most "
                           f"{limits.max_pixels}", "size")
    return width, height


def _input_reference(value: Any) -> bytes:
    """The file ``input_reference`` carries: the file itself (a form's file part), base64
    (line breaks and other whitespace ignored), or a base64 data URL (its scheme and
    ``;base64`` in any case), alone or as OpenAI's ``{"image_url": ...}``."""
    if isinstance(value, bytes) and value:
        return value
    if isinstance(value, dict) and set(value) == {"file_id"}:
        raise RequestError("input_reference names an uploaded file (file_id), and this server "
                           "keeps no files; expected the image itself, as a file, base64 or a "
                           "data:image/...;base64, URL (image_url)", "input_reference")
    if isinstance(value, dict) and set(value) == {"image_url"}:
        value = value["image_url"]
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
        shown = _shown(value)[:40]
        raise RequestError(f"input_reference is {shown}; expected a PNG, JPEG or WebP image as "
                           "base64 or a data:image/...;base64, URL", "input_reference")
    return data


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
        raise RequestError(f"prompt is {_shown(prompt)}; expected non-empty text", "prompt")
    negative = body.get("negative_prompt") or ""
    if not isinstance(negative, str):
        raise RequestError(f"negative_prompt is {_shown(negative)}; expected text",
                           "negative_prompt")
    width, height = _size(body, limits)
    n = _get_int(body, "n", 1, 1, limits.max_n)
    steps = _get_int(body, "steps", 20, 1, limits.max_steps)
    guidance = body.get("guidance", 5.0)
    if not _is_number(guidance) or guidance < 1:
        raise RequestError(f"guidance is {_shown(guidance)}; expected a number >= 1 (1: no "
                           "guidance; Wan uses 5)", "guidance")
    if guidance == 1 and negative:
        raise RequestError("negative_prompt is set at guidance 1, which runs the conditional "
                           "branch alone; expected no negative_prompt, or guidance above 1",
                           "negative_prompt")
    scheduler, shift = body.get("scheduler"), body.get("shift")
    if isinstance(shift, bool):
        raise RequestError(f"shift is {_shown(shift)}; expected a positive number", "shift")
    try:
        check_sampler(scheduler)
        check_shift(shift)
    except SamplerInputError as exc:
        raise RequestError(str(exc), "scheduler" if exc.parameter == "sampler"
                           else exc.parameter) from None
    cache = body.get("cache")
    if cache is not None:
        if not isinstance(cache, str):
            raise RequestError(f"cache is {_shown(cache)}; expected a string such as "
                               "\"first-block:0.05\"", "cache")
        try:
            setting = StepCacheSetting.parse(cache)
        except SamplerInputError as exc:
            raise RequestError(str(exc), "cache") from None
        if setting.calibrate:
            raise RequestError(
                f"cache {cache!r} measures the ratios into the served export; expected a cache "
                "to run (calibrate once with `numaov run wan --cache magcache:calibrate`)",
                "cache")
        cache = str(setting)
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(62)
    elif not _is_int(seed) or not 0 <= seed < 2**62:
        raise RequestError(f"seed is {_shown(seed)}; expected an integer in 0 .. 2**62-1",
                           "seed")
    response_format = body.get("response_format") or "b64_json"
    if response_format not in ("b64_json", "url"):
        raise RequestError(f"response_format is {_shown(response_format)}; expected "
                           "\"b64_json\" or \"url\"", "response_format")
    frames, kind = 1, "png"
    if video:
        if body.get("frames") is not None and body.get("seconds") is not None:
            raise RequestError("frames and seconds are both set; expected one of them",
                               "seconds")
        if body.get("seconds") is not None:
            seconds = body["seconds"]
            if isinstance(seconds, str) and _DECIMAL.fullmatch(seconds):
                seconds = float(seconds)  # OpenAI's video API sends seconds as a string
            if not _is_number(seconds) or seconds <= 0:
                raise RequestError(f"seconds is {_shown(body['seconds'])}; expected a "
                                   "positive number", "seconds")
            frames = 4 * max(round(seconds * DEFAULT_FPS / 4), 1) + 1
            if frames > limits.max_frames:
                raise RequestError(f"seconds {seconds} is {frames} frames at {DEFAULT_FPS}/s; "
                                   f"expected at most {limits.max_frames} frames", "seconds")
        else:
            frames = body.get("frames", 17)
            if not _is_int(frames) or not 1 <= frames <= limits.max_frames:
                top = (limits.max_frames - 1) // 4 * 4 + 1
                raise RequestError(f"frames is {_shown(frames)}; expected 4k+1 frames up to "
                                   f"{limits.max_frames}: 1, 5, 9, ..., {top}", "frames")
            if (frames - 1) % 4:
                raise RequestError(f"frames is {frames}; expected 4k+1 frames (Wan's VAE), "
                                   f"such as {(frames - 1) // 4 * 4 + 1} or "
                                   f"{(frames - 1) // 4 * 4 + 5}", "frames")
        kind = body.get("format") or "mp4"
        if not isinstance(kind, str) or kind not in FORMATS:
            raise RequestError(f"format is {_shown(kind)}; expected one of "
                               f"{', '.join(FORMATS)}", "format")
    image = (None if body.get("input_reference") is None
             else _input_reference(body["input_reference"]))
    return VideoJob(prompt, negative, width, height, frames, steps, float(guidance),
                    [(seed + j) % 2**62 for j in range(n)], kind, response_format == "url",
                    image, scheduler=scheduler, shift=None if shift is None else float(shift),
                    cache=cache)


IMAGE_FIELDS = ("model", "prompt", "negative_prompt", "n", "size", "response_format", "seed",
                "steps", "guidance", "scheduler", "shift", "cache", "user", "quality", "style")
# A video job (POST /v1/videos) makes one video, fetched from its content route.
VIDEO_FIELDS = ("model", "prompt", "negative_prompt", "size", "seed", "steps", "guidance",
                "scheduler", "shift", "cache", "frames", "seconds", "format", "input_reference",
                "user")
# --sync-videos: the answer carries the videos, n of them, as base64 or URLs.
SYNC_VIDEO_FIELDS = (*VIDEO_FIELDS, "n", "response_format")
_FORM_INTEGERS = ("n", "seed", "steps", "frames")
_FORM_NUMBERS = ("guidance", "shift")


def form_values(body: Any) -> Any:
    """A multipart form's fields as JSON would carry them: the integer and number fields'
    text as numbers (text that is not one stays text, and its check names the field)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for name in (*_FORM_INTEGERS, *_FORM_NUMBERS):
        value = out.get(name)
        if not isinstance(value, str) or not value.isascii():  # int() reads "٣" as 3 too
            continue
        try:
            out[name] = int(value) if name in _FORM_INTEGERS else float(value)
        except ValueError:
            pass
    return out


def check_video_job(job: VideoJob, pipeline: Any, model_name: str, video: bool) -> VideoJob:
    """``job`` against the served export (a ``WanPipelineExport``), before it queues: an
    image for an export that cannot take one, or none for one that needs it (the export's
    :class:`~numaov.runtime.wan.pipeline.ImageRule`, said without the server's paths); then
    the image itself, of the video's size, decoded once: the job carries its pixels."""
    from numaov.runtime.wan.image_input import ImageInputError, read_image
    from numaov.runtime.wan.pipeline import IMAGE_INCOMPLETE, IMAGE_NEEDED, IMAGE_REFUSED

    rule = pipeline.image_rule
    problem = rule.problem(job.image is not None)
    if problem == IMAGE_REFUSED:
        raise RequestError(f"input_reference is set, but {model_name!r} has no image "
                           "conditioning (a text-to-video export); expected no "
                           "input_reference", "input_reference")
    if problem == IMAGE_INCOMPLETE:
        raise RequestError(f"{model_name!r} is an image-to-video export without its "
                           f"{' or '.join(map(repr, rule.missing))} graph; expected a complete "
                           "re-export of the pipeline directory", "input_reference", 500,
                           kind="server_error")
    if problem == IMAGE_NEEDED:
        where = ("expected input_reference, the video's first frame" if video else
                 "expected POST /v1/videos with input_reference, the video's first frame")
        raise RequestError(f"{model_name!r} is image-to-video: {where}", "input_reference")
    if job.cache is not None:
        check_served_cache(job.cache, pipeline, model_name)
    if job.image is None:
        return job
    try:
        pixels = read_image(io.BytesIO(job.image), job.height, job.width,
                            name="input_reference")
    except ImageInputError as exc:
        raise RequestError(str(exc), "input_reference") from None
    return dataclasses.replace(job, pixels=pixels)


def check_served_cache(cache: str, pipeline: Any, model_name: str) -> None:
    """A MagCache job on an export whose transformers have their magnitude ratios (said
    without the server's paths)."""
    from numaov.runtime.wan.step_cache import MAGCACHE, read_ratios

    if StepCacheSetting.parse(cache).kind != MAGCACHE:
        return
    try:
        for expert in pipeline.experts:
            read_ratios(expert.directory, 1)
    except SamplerInputError:
        raise RequestError(
            f"cache {cache!r} needs {model_name!r}'s measured magnitude ratios, which its export "
            "lacks (measured once on the server with `numaov run wan --cache "
            "magcache:calibrate`); expected another cache or none", "cache") from None

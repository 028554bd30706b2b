"""The Wan pipeline a server holds: one generation at a time on the pipeline's own thread.

``VideoService(model_dir, model_name)`` reads the pipeline export (a bad export fails at
start), then runs each image or video of a checked job
(:class:`~numaov.runtime.service.video_requests.VideoJob`) as one
:func:`numaov.runtime.wan.pipeline.run_wan_pipeline` call (choice ``j`` with ``seed + j``):
requests queue (``admit`` refuses beyond the server's ``--max-queue`` waiting), each graph is
compiled by the first generation that runs it and kept (``manifest_reader.keep_compiled``).
The conditioning image goes in as the pixels the request check decoded, and the frames come
back as the encoded file's bytes (``video_output.encode_video``): nothing is written to disk.
The pipeline runs in the server's process on the CPUs it may use, shared with the LM's
pinned workers when both are served.

The HTTP routes over it are in :mod:`numaov.runtime.service.video_routes`.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from numaov import NumaovError
from numaov.runtime.service.video_requests import VideoJob, VideoLimits
from numaov.runtime.wan.video_output import DEFAULT_FPS

KEPT_RESULTS = 64


class VideoService:
    """An exported Wan pipeline served one generation at a time on its own thread."""

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

    def __enter__(self) -> VideoService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- generating -------------------------------------------------------------------------

    def admit(self, job: VideoJob, max_queue: int) -> int | None:
        """Count the job's generations as waiting: None, or, when that would pass
        ``max_queue``, the number waiting now (and nothing is counted)."""
        with self._lock:
            if self._waiting + len(job.seeds) > max_queue:
                return self._waiting
            self._waiting += len(job.seeds)
            return None

    async def generate(self, job: VideoJob) -> list[tuple[bytes, str]]:
        """Every choice of an admitted job, in order, as (file bytes, media type). Every
        generation runs to its end; then the first error is raised (one that is not the
        pipeline's own check of the request is kept for ``health``)."""
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._executor, self._generate, job, seed)
                   for seed in job.seeds]
        outputs = await asyncio.gather(*futures, return_exceptions=True)
        for output in outputs:
            if isinstance(output, BaseException):
                if not isinstance(output, NumaovError):
                    with self._lock:
                        self._failures.append((time.time(), str(output)))
                raise output
        return outputs

    def _generate(self, job: VideoJob, seed: int) -> tuple[bytes, str]:
        from numaov.runtime.manifest_reader import keep_compiled
        from numaov.runtime.wan.pipeline import run_wan_pipeline
        from numaov.runtime.wan.request import WanSampleRequest
        from numaov.runtime.wan.video_output import encode_video

        with self._lock:
            self._waiting -= 1
            self._running += 1
        try:
            with keep_compiled(self._compiled):
                request = WanSampleRequest(frames=job.frames, height=job.height, width=job.width,
                                           steps=job.steps, guidance=job.guidance, seed=seed)
                result = run_wan_pipeline(self.model_dir, request, job.prompt, None,
                                          negative_prompt=job.negative_prompt,
                                          backend=self.backend, image=job.pixels)
            media, kind = job.output
            return encode_video(result.frames, kind, DEFAULT_FPS), media
        finally:
            with self._lock:
                self._running -= 1
                self._done += 1

    # -- results kept for URL answers -------------------------------------------------------

    def keep(self, data: bytes, media: str) -> str:
        """Keep a result for ``result`` (the last ``KEPT_RESULTS``); its key."""
        key = uuid.uuid4().hex
        with self._lock:
            self._results[key] = (data, media)
            while len(self._results) > KEPT_RESULTS:
                self._results.popitem(last=False)
        return key

    def result(self, key: str) -> tuple[bytes, str] | None:
        with self._lock:
            return self._results.get(key)

"""The Wan pipeline a server holds: every image or video is a job, run one at a time in a
worker process.

``VideoService(model_dir, model_name)`` reads the pipeline export (a bad export fails at
start); :meth:`VideoService.start` starts its worker and fixes the memory budget. Each request
becomes a :class:`Generation`: the checked job
(:class:`~numaov.runtime.service.video_requests.VideoJob`), its memory estimate, its status
(``queued``, ``in_progress``, ``completed``, ``failed``, as OpenAI's video API names them),
its progress and, once made, its files. Generations run in creation order, one at a time:

- **The worker** is one process (spawned: it inherits nothing of the server) that runs each
  choice of a job as one :func:`~numaov.runtime.wan.pipeline.run_wan_pipeline` call (choice
  ``j`` with ``seed + j``), keeps every graph it compiled for its life
  (``manifest_reader.keep_compiled``), reports each denoising step (the pipeline's own
  progress callback) and sends back the encoded file (``video_output.encode_video``) and, for
  a video, its first frame as a PNG thumbnail. A process, not a thread, for two reasons:
  cancelling a generation (:meth:`VideoService.delete`, a client that goes away, the server
  stopping) kills it, which frees all the generation held at once, wherever it was (a
  denoising step, the VAE's frame loop, encoding), and a fresh worker is started at once for
  the next job (its graphs compile again); and its Python work never takes the server's GIL,
  so the event loop and the LM's streams do not wait on it. It runs unpinned, on the CPUs
  the server may use (``NUMAOV_CPU_BIND`` places the LM's rank workers only).
- **The memory budget** (bytes; default: ``MemAvailable`` once the worker and the LM are
  loaded): a job's estimate (:func:`estimate_job_memory`, the estimate ``run_wan_pipeline``
  checks itself) is held from the moment it starts until it ends. A job whose estimate is
  larger than the whole budget is refused at once, with the numbers; one that fits waits in
  the queue until what is left holds it (with one job at a time, until the one before ends).
- **The results**: finished generations are kept, with their files in memory, up to
  ``results.count`` of them and ``results.bytes`` of files (the oldest finished one is
  dropped first), each for ``results.ttl_s`` after it finished (``expires_at``); then its id
  is unknown (404). A video larger than the whole store fails, saying so.

The HTTP routes over it are in :mod:`numaov.runtime.service.video_routes`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numaov import NumaovError
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.video_requests import PNG, VideoJob, VideoLimits
from numaov.runtime.wan.memory import MemoryEstimate, available_memory
from numaov.runtime.wan.video_output import DEFAULT_FPS

logger = logging.getLogger(__name__)

KEPT_RESULTS = 64
KEPT_RESULT_BYTES = 1 << 30  # 1 GiB of files
RESULT_TTL_S = 3600  # an hour, as OpenAI keeps a video's assets
CREATED_ORDER_KEPT = 100_000  # ids whose place in the listing a cursor finds (about 10 MB)
WORKER_START_S = 300.0  # importing the runtime and OpenVINO takes seconds; a loaded machine more
POLL_S = 0.1  # how often the dispatcher looks at a cancel flag while the worker computes
QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
# The pipeline's progress line for a denoising step (sampler.sample).
_STEP = re.compile(r"step (\d+)/(\d+)\b")
_GIB = 1 << 30


class VideoWorkerError(NumaovError):
    """The video worker process did not start, or died."""


@dataclass(frozen=True)
class ResultLimits:
    """How many finished generations are kept (``count``), how many bytes of files they may
    hold (``bytes``) and for how long after they finish (``ttl_s``)."""

    count: int = KEPT_RESULTS
    bytes: int = KEPT_RESULT_BYTES
    ttl_s: float = RESULT_TTL_S


@dataclass(frozen=True)
class Output:
    """One made file: its bytes, media type and (a video's) first frame as PNG."""

    data: bytes
    media: str
    thumbnail: bytes | None = None


@dataclass(eq=False)
class Generation:
    """One image or video job and what became of it."""

    id: str
    kind: str  # "video" or "image"
    job: VideoJob
    estimate: MemoryEstimate
    created_at: int
    keep: bool = True  # kept once finished (an image answered in base64 is not)
    status: str = QUEUED
    progress: int = 0  # percent
    completed_at: int | None = None
    expires_at: int | None = None
    # {"code", "message", "param", "type", "status"} when failed (status: the HTTP status a
    # synchronous answer gives it)
    error: dict[str, Any] | None = None
    outputs: list[Output] = field(default_factory=list)
    cancelled: bool = False
    finished_at: float | None = None  # time.monotonic(), for the expiry
    _wake: list[Callable[[], None]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status in (COMPLETED, FAILED)

    @property
    def nbytes(self) -> int:
        return sum(len(o.data) + len(o.thumbnail or b"") for o in self.outputs)


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f} GiB"


def estimate_job_memory(pipeline: Any, job: VideoJob) -> MemoryEstimate:
    """What ``run_wan_pipeline`` estimates for ``job`` on ``pipeline`` (a
    ``WanPipelineExport``) on one worker. Raises the pipeline's own error for a size or a
    frame count it does not take."""
    from numaov.runtime.wan.pipeline import TRANSFORMER, VAE_FIRST_FRAME, estimate_pipeline_memory
    from numaov.runtime.wan.request import latent_shape
    from numaov.runtime.wan.vae import VaeGeometry

    geometry = VaeGeometry.of(pipeline.components[VAE_FIRST_FRAME])
    shape = latent_shape(pipeline.components[TRANSFORMER].config, job.frames, job.height,
                         job.width, geometry.spatial, geometry.temporal)
    return estimate_pipeline_memory(pipeline, shape, 1, 1 if job.guidance == 1 else 2,
                                    conditioned=job.image is not None)


# -- the worker process -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Work:
    """One job as the worker gets it (plain data: it is pickled into the worker's pipe): the
    checked request, how to encode what it makes and whether to add a first-frame thumbnail."""

    job: VideoJob
    kind: str  # encode_video's kind: ".mp4", ".webp", ".png"
    media: str
    thumbnail: bool


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:  # the server was killed: do not linger with its memory
            os._exit(0)


def _trim_memory() -> None:
    """Give freed heap back to the system after a job (glibc keeps it otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _worker_main(conn: Any, model_dir: str, backend: str) -> None:
    """The worker's body: import the pipeline once, then run every job sent to it."""
    # Ctrl-C in a terminal reaches the whole process group: the server decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Unpinned by design (see the module's docstring): the LM's bind string is not ours, and
    # the pipeline would warn that it does not apply here on every start.
    os.environ.pop("NUMAOV_CPU_BIND", None)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        import torch  # noqa: F401 - the pipeline's noise; imported before "ready", not in a job

        from numaov.runtime.manifest_reader import keep_compiled
        from numaov.runtime.wan.pipeline import run_wan_pipeline
        from numaov.runtime.wan.request import WanSampleRequest
        from numaov.runtime.wan.video_output import encode_video
    except Exception as exc:  # noqa: BLE001 - said to the server, which fails to start
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    compiled: dict = {}
    while True:
        try:
            work = conn.recv()
        except EOFError:
            return
        if work is None:
            return
        try:
            with keep_compiled(compiled):
                job = work.job
                for index, seed in enumerate(job.seeds):
                    def progress(text: str, index: int = index) -> None:
                        match = _STEP.match(text)
                        if match:
                            conn.send(("progress", index, int(match[1]), int(match[2])))

                    request = WanSampleRequest(frames=job.frames, height=job.height,
                                               width=job.width, steps=job.steps,
                                               guidance=job.guidance, seed=seed,
                                               sampler=job.scheduler, shift=job.shift,
                                               cache=job.cache)
                    result = run_wan_pipeline(model_dir, request, job.prompt, None,
                                              negative_prompt=job.negative_prompt,
                                              backend=backend, image=job.pixels,
                                              progress=progress)
                    data = encode_video(result.frames, work.kind, DEFAULT_FPS)
                    thumbnail = (encode_video(result.frames[:1], PNG[1]) if work.thumbnail
                                 else None)
                    del result
                    conn.send(("output", data, work.media, thumbnail))
            conn.send(("done", len(compiled)))
        except NumaovError as exc:  # the pipeline's own checks of the request
            conn.send(("failed", str(exc), exc.parameter, True))
        except Exception as exc:  # noqa: BLE001 - the worker stays; the server reports it
            conn.send(("failed", f"{type(exc).__name__}: {exc}", None, False))
        finally:
            _trim_memory()


class _Worker:
    """The worker process and the server's end of its pipe."""

    def __init__(self, process: Any, conn: Any) -> None:
        self.process = process
        self.conn = conn

    @classmethod
    def start(cls, model_dir: Path, backend: str, stopping: Callable[[], bool]) -> _Worker:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_worker_main, args=(theirs, str(model_dir), backend),
                              name="numaov-video", daemon=True)
        process.start()
        theirs.close()
        worker = cls(process, ours)
        deadline = time.monotonic() + WORKER_START_S
        while time.monotonic() < deadline and not stopping():
            try:
                message = worker.receive(POLL_S * 2)
            except VideoWorkerError as exc:
                raise VideoWorkerError(f"the video worker did not start: {exc}") from None
            if message is None:
                continue
            if message[0] == "ready":
                return worker
            worker.kill()
            raise VideoWorkerError(f"the video worker did not start: {message[1]}")
        worker.kill()
        raise VideoWorkerError("the video worker did not start within "
                               f"{WORKER_START_S:.0f} s" if not stopping() else
                               "the server is stopping")

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except OSError:
            raise VideoWorkerError(self._gone()) from None

    def receive(self, timeout: float) -> tuple | None:
        """The worker's next message, or None after ``timeout`` without one; raises
        :class:`VideoWorkerError` once the worker is gone."""
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            raise VideoWorkerError(self._gone()) from None
        if not self.process.is_alive():
            raise VideoWorkerError(self._gone())
        return None

    def _gone(self) -> str:
        self.process.join(timeout=1)
        return f"the video worker exited (exit code {self.process.exitcode})"

    def kill(self) -> None:
        """Stop it now; what it held is freed with it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()


# -- the service ------------------------------------------------------------------------------


class VideoService:
    """An exported Wan pipeline: generations queued, run one at a time in a worker process,
    kept once finished."""

    def __init__(self, model_dir: str | Path, model_name: str, backend: str = "openvino",
                 limits: VideoLimits | None = None, *, results: ResultLimits | None = None,
                 memory_budget: int | None = None) -> None:
        from numaov.runtime.wan.pipeline import read_pipeline

        self.pipeline = read_pipeline(model_dir)  # checked now: a bad export fails at start
        self.model_dir = Path(model_dir)
        self.model_name = model_name
        self.backend = backend
        self.limits = limits or VideoLimits()
        self.results = results or ResultLimits()
        # None until start(): then the flag's value, or MemAvailable (None where unknown:
        # no budget)
        self.memory_budget = memory_budget
        self._budget_flag = memory_budget is not None
        self._cond = threading.Condition()
        self._generations: dict[str, Generation] = {}  # every known one, in creation order
        # id -> creation number of the last CREATED_ORDER_KEPT made, gone ones included: a
        # listing's cursor places itself after its video was deleted or expired
        self._created_order: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._queue: collections.deque[Generation] = collections.deque()
        self._finished: collections.OrderedDict[str, Generation] = collections.OrderedDict()
        self._running: Generation | None = None
        self._worker: _Worker | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False  # set without a lock: stop() runs from a signal handler
        self._done = 0
        self._compiled = 0
        self._worker_starts = 0
        self._failures: collections.deque = collections.deque(maxlen=8)
        # Called with each generation as it finishes (the routes count outcomes with it).
        self.on_finish: Callable[[Generation], None] | None = None

    # -- life -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker (its imports take seconds; a worker that cannot start fails the
        server's start), then fix the memory budget and start taking jobs."""
        self._worker = self._start_worker()
        if self.memory_budget is None:
            self.memory_budget = available_memory()
        self._thread = threading.Thread(target=self._dispatch, name="numaov-video",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop taking jobs; the running one and the queued ones fail ("the server is
        stopping") and the worker is killed, within ``POLL_S``. Safe in a signal handler."""
        self._stopping = True

    def close(self) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def __enter__(self) -> VideoService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_worker(self) -> _Worker:
        worker = _Worker.start(self.model_dir, self.backend, lambda: self._stopping)
        with self._cond:
            self._worker_starts += 1
            self._compiled = 0
        return worker

    # -- what the routes ask ----------------------------------------------------------------

    def queue_depth(self) -> int:
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def health(self) -> dict[str, Any]:
        with self._cond:
            self._expire()
            running = self._running
            worker = self._worker
            return {
                "state": "ok", "model": self.model_name, "backend": self.backend,
                "worker": {"pid": worker.pid if worker is not None else None,
                           "starts": self._worker_starts},
                "waiting": len(self._queue), "running": 1 if running is not None else 0,
                "running_id": running.id if running is not None else None,
                "done": self._done, "compiled_graphs": self._compiled,
                "memory": {"budget_bytes": self.memory_budget,
                           "in_use_bytes": running.estimate.total if running else 0},
                "results": {"count": len(self._finished),
                            "bytes": sum(g.nbytes for g in self._finished.values()),
                            "max_count": self.results.count,
                            "max_bytes": self.results.bytes, "ttl_s": self.results.ttl_s},
                "failures": [{"time": t, "error": e} for t, e in self._failures]}

    def create(self, job: VideoJob, kind: str, max_queue: int, keep: bool = True) -> Generation:
        """Queue ``job`` as a new generation. Refused (:class:`RequestError`): a size or frame
        count the pipeline does not take (400, from its own check), an estimate above the
        memory budget (400, with the numbers), a full queue (429), a stopping server (503)."""
        estimate = estimate_job_memory(self.pipeline, job)
        budget = self.memory_budget
        if budget is not None and estimate.total > budget:
            origin = ("--video-memory" if self._budget_flag else
                      "MemAvailable when the server started, set it with --video-memory")
            raise RequestError(
                f"this {kind} needs {estimate.describe()}, more than the server's memory "
                f"budget for video work, {_gib(budget)} ({origin}); expected fewer frames or "
                "a smaller size", "size", code="insufficient_memory")
        with self._cond:
            if self._stopping:
                raise RequestError("the server is stopping; expected a retry once it is back",
                                   None, 503, kind="server_error")
            if len(self._queue) + 1 > max_queue:
                raise RequestError(
                    f"the queue is full ({len(self._queue)} generations waiting, at most "
                    f"{max_queue}); expected a retry later", None, 429,
                    kind="rate_limit_error", headers={"Retry-After": "5"})
            prefix = "video" if kind == "video" else "img"
            generation = Generation(f"{prefix}_{uuid.uuid4().hex}", kind, job, estimate,
                                    int(time.time()), keep=keep)
            self._generations[generation.id] = generation
            self._created_order[generation.id] = (
                next(reversed(self._created_order.values())) + 1 if self._created_order else 0)
            if len(self._created_order) > CREATED_ORDER_KEPT:
                self._created_order.popitem(last=False)
            self._queue.append(generation)
            self._cond.notify_all()
        return generation

    def get(self, generation_id: str) -> Generation | None:
        with self._cond:
            self._expire()
            return self._generations.get(generation_id)

    def created_order(self, generation_id: str) -> int | None:
        """Where ``generation_id`` was made among the others (larger: later), also after it
        was deleted or expired; None for an id this server did not make (or long ago)."""
        with self._cond:
            return self._created_order.get(generation_id)

    def listing(self, kind: str = "video") -> list[Generation]:
        """Every known generation of ``kind``, in creation order."""
        with self._cond:
            self._expire()
            return [g for g in self._generations.values() if g.kind == kind]

    def discard(self, generation_id: str) -> None:
        """Forget a finished generation (an image answered in base64)."""
        with self._cond:
            generation = self._generations.get(generation_id)
            if generation is not None and generation.finished:
                self._generations.pop(generation_id)
                self._finished.pop(generation_id, None)

    def cancel(self, generation_id: str) -> Generation | None:
        """Forget a generation: a queued one leaves the queue (failed, "cancelled"), a running
        one is marked for the dispatcher, which kills the worker within ``POLL_S``, a finished
        one's files are dropped. None: no such generation. Never waits."""
        with self._cond:
            generation = self._generations.pop(generation_id, None)
            if generation is None:
                return None
            self._finished.pop(generation_id, None)
            if generation.status == QUEUED:
                self._queue.remove(generation)
                self._finish(generation, FAILED, _error("cancelled", "the job was deleted "
                                                        "before it started", 499))
            elif generation.status == IN_PROGRESS:
                generation.cancelled = True
        return generation

    async def delete(self, generation_id: str) -> Generation | None:
        """:meth:`cancel`, then wait until a running generation's worker is gone: its memory
        is free when this returns."""
        generation = self.cancel(generation_id)
        if generation is not None and not generation.finished:
            await self.wait(generation)
        return generation

    async def wait(self, generation: Generation) -> None:
        """Return once ``generation`` has finished (completed or failed)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the loop is closed: the server stopped
                pass

        with self._cond:
            if generation.finished:
                return
            generation._wake.append(wake)
        await done

    # -- bookkeeping (under the lock) -------------------------------------------------------

    def _finish(self, generation: Generation, status: str,
                error: dict[str, Any] | None = None) -> None:
        generation.status = status
        generation.error = error
        generation.completed_at = int(time.time())
        generation.finished_at = time.monotonic()
        if status == COMPLETED:
            generation.progress = 100
            self._done += 1
        if generation.keep and generation.id in self._generations:
            generation.expires_at = generation.completed_at + int(self.results.ttl_s)
            if generation.nbytes > self.results.bytes:
                kept = generation.nbytes
                generation.outputs = []
                generation.status = FAILED
                generation.error = _error(
                    "result_too_large", f"the {generation.kind} is {kept} bytes, more than the "
                    f"server keeps ({self.results.bytes} bytes, --video-results-size); "
                    "expected a smaller video (fewer frames or a smaller size)", 500)
            self._finished[generation.id] = generation
            self._evict()
        for wake in generation._wake:
            wake()
        generation._wake.clear()
        if self.on_finish is not None:
            self.on_finish(generation)

    def _evict(self) -> None:
        """Drop the oldest finished generations beyond the store's count and bytes."""
        total = sum(g.nbytes for g in self._finished.values())
        while self._finished and (len(self._finished) > self.results.count
                                  or total > self.results.bytes):
            _, oldest = self._finished.popitem(last=False)
            total -= oldest.nbytes
            self._generations.pop(oldest.id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._finished:
            oldest = next(iter(self._finished.values()))
            if oldest.finished_at is None or now - oldest.finished_at < self.results.ttl_s:
                break
            self._finished.popitem(last=False)
            self._generations.pop(oldest.id, None)

    # -- the dispatcher thread --------------------------------------------------------------

    def _dispatch(self) -> None:
        while True:
            if self._worker is None and not self._stopping:
                try:  # a fresh worker after a cancel: ready before the next job comes
                    self._worker = self._start_worker()
                except VideoWorkerError as exc:
                    if not self._stopping:
                        logger.error("%s", exc)
                        with self._cond:
                            self._failures.append((time.time(), str(exc)))
            with self._cond:
                while not self._stopping and not self._queue:
                    self._expire()
                    self._cond.wait(POLL_S * 5)
                if self._stopping:
                    break
                generation = self._queue.popleft()
                generation.status = IN_PROGRESS
                self._running = generation
            try:
                self._execute(generation)
            except Exception as exc:  # noqa: BLE001 - the service stays up; health shows it
                self._failed(generation, f"generation failed: {exc}")
            finally:
                with self._cond:
                    self._running = None
        stopping = _error("server_stopping", "the server is stopping; expected a retry once "
                          "it is back", 503)
        if self._worker is not None:
            self._worker.kill()
            self._worker = None
        with self._cond:
            for generation in [*self._queue, *([self._running] if self._running else [])]:
                if not generation.finished:
                    self._finish(generation, FAILED, stopping)
            self._queue.clear()

    def _failed(self, generation: Generation, message: str) -> None:
        with self._cond:
            self._failures.append((time.time(), message))
            if not generation.finished:
                self._finish(generation, FAILED, _error("server_error", message, 500))

    def _execute(self, generation: Generation) -> None:
        job = generation.job
        media, kind = job.output
        work = _Work(job, kind, media, generation.kind == "video")
        try:
            if self._worker is None or not self._worker.process.is_alive():
                if self._worker is not None:  # it died while idle
                    self._worker.kill()
                self._worker = None
                self._worker = self._start_worker()
            worker = self._worker
            worker.send(work)
        except VideoWorkerError as exc:
            self._worker = None
            self._failed(generation, str(exc))
            return
        units = len(job.seeds) * (job.steps + 1)  # each choice's steps, then its decoding
        outputs: list[Output] = []
        while True:
            if generation.cancelled or self._stopping:
                worker.kill()  # everything the job held is freed with the process
                self._worker = None
                with self._cond:
                    if not generation.finished:
                        self._finish(generation, FAILED, _error(
                            "server_stopping" if self._stopping else "cancelled",
                            "the server is stopping; expected a retry once it is back"
                            if self._stopping else "the job was deleted while it ran",
                            503 if self._stopping else 499))
                return
            try:
                message = worker.receive(POLL_S)
            except VideoWorkerError as exc:
                self._worker = None
                self._failed(generation, f"{exc} while generating")
                return
            if message is None:
                continue
            what = message[0]
            if what == "progress":
                index, step, _ = message[1:]
                with self._cond:
                    generation.progress = max(generation.progress, min(
                        99, 100 * (index * (job.steps + 1) + step) // units))
            elif what == "output":
                outputs.append(Output(*message[1:]))
            elif what == "done":
                with self._cond:
                    self._compiled = message[1]
                    generation.outputs = outputs
                    self._finish(generation, COMPLETED)
                return
            elif what == "failed":
                text, parameter, request_error = message[1:]
                if request_error:
                    with self._cond:
                        self._finish(generation, FAILED, _error(
                            "invalid_request", text, 400, parameter=parameter,
                            kind="invalid_request_error"))
                else:
                    self._failed(generation, f"generation failed: {text}")
                return


def _error(code: str, message: str, status: int, *, parameter: str | None = None,
           kind: str = "server_error") -> dict[str, Any]:
    return {"code": code, "message": message, "param": parameter, "type": kind,
            "status": status}

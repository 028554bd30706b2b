"""The HTTP service: OpenAI-style completions over long-lived DP-rank workers.

``LMService(model_dir)`` starts one worker per rank of the binding plan, as ``numaov run
deepseek`` does, but the workers stay: each pins itself, joins the model's collective group,
loads and compiles its rank's graph once, then serves batches until the service closes. A
batch is sent to every rank (prompt ``i`` to rank ``i % dp``; idle ranks run with 0 rows,
because the collectives in the graph need every rank at every step) and the ranks' tokens come
back in prompt order. Batches run one at a time; a request waits for the one before it.

``build_app(service)`` is the FastAPI application; ``listen(host, port)`` binds its socket
(before the workers start, so a taken port fails at once) and ``serve_forever(app, sock)``
runs it with uvicorn until SIGINT or SIGTERM, as ``numaov serve`` does:

- ``GET /health``: ``{"status": "ok", ...}``, or HTTP 503 once the workers have failed.
- ``GET /v1/models``: the one model served.
- ``POST /v1/completions``: ``prompt`` as text, a list of texts (both need ``--tokenizer``), a
  list of token ids or a list of such lists; ``max_tokens`` (default 16). Decoding is greedy:
  ``temperature`` 0 and ``top_p`` 1 are accepted, other values, ``n`` > 1, ``stream``,
  ``logprobs``, ``echo`` and ``stop`` are refused with HTTP 400 rather than ignored. Each choice
  carries ``text`` (decoded when the server has a tokenizer, else empty) and ``token_ids``; it
  ends at the model's end-of-sequence token (``finish_reason`` "stop", the token left out) or
  after ``max_tokens`` ("length").

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with HTTP 400 for
bad input, 404 for another model name, 503 when the workers are gone.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue as queue_module
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from numaov import NumaovError
from numaov.runtime.binding import BindingPlan
from numaov.runtime.lm_engine import (
    GENERATION_TIMEOUT_S,
    GenerationInputError,
    GenerationResult,
    Progress,
    RankModel,
    check_prompts,
    open_lm_manifest,
    resolve_plan,
    split_prompts,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
# Loading and compiling a rank's graph; a real checkpoint can take minutes.
STARTUP_TIMEOUT_S = 1800.0
_POLL_S = 0.2


class ServiceError(NumaovError):
    """The service's workers failed, stopped or did not start."""


class CompletionRequestError(NumaovError):
    """A completion request the service cannot run; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


# -- the workers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ServeJob:
    model_dir: str
    backend: str
    requests: Any  # this rank's queue of (request id, prompts, max new tokens) or None
    replies: Any  # shared queue of ("ready" | "done", rank, payload)


def _serve_rank(context: Any, job: _ServeJob) -> int:
    """Worker body: load this rank's model once, then run every batch sent to it."""
    model = RankModel(context, job.model_dir, job.backend)
    parent = os.getppid()
    served = 0
    try:
        job.replies.put(("ready", context.rank, model.load_seconds))
        while True:
            try:
                item = job.requests.get(timeout=_POLL_S * 5)
            except queue_module.Empty:
                if os.getppid() != parent:  # the service was killed: do not linger
                    break
                continue
            if item is None:
                break
            request_id, prompts, max_new_tokens = item
            job.replies.put(("done", context.rank,
                             (request_id, model.generate(prompts, max_new_tokens))))
            served += 1
    finally:
        model.close()
    return served


class LMService:
    """Long-lived rank workers for one exported DeepSeek-V2 model; thread-safe."""

    def __init__(self, model_dir: str | Path, backend: str = "openvino", *,
                 plan: BindingPlan | None = None, progress: Progress = None) -> None:
        from numaov.runtime.workers import run_on_ranks

        report = progress or (lambda _msg: None)
        self.manifest = open_lm_manifest(model_dir, backend)
        self.backend = backend
        self.world_size = self.manifest.world_size
        self.plan, self.placement = resolve_plan(self.manifest, plan)
        ctx = mp.get_context("spawn")
        self._requests = [ctx.Queue() for _ in range(self.world_size)]
        self._replies = ctx.Queue()
        self._lock = threading.Lock()
        self._next_id = 0
        self._failure: str | None = None
        self._started = False
        self._closed = False
        jobs = [_ServeJob(str(self.manifest.directory), backend, self._requests[r], self._replies)
                for r in range(self.world_size)]

        def run_workers() -> None:
            try:
                run_on_ranks(self.plan, _serve_rank, jobs, group=self.manifest.collective_group,
                             timeout_s=float("inf"))
            except Exception as exc:  # noqa: BLE001 - kept for every later request to report
                self._failure = str(exc)
                if self._started:  # a failure while starting is raised to the caller instead
                    logger.error("the rank workers stopped: %s", exc)

        report(f"starting {self.world_size} worker(s) on {backend} ({self.placement})")
        self._thread = threading.Thread(target=run_workers, name="numaov-lm-workers",
                                        daemon=True)
        self._thread.start()
        try:
            ready = self._collect("ready", None, STARTUP_TIMEOUT_S, "starting")
        except ServiceError:
            self.close()
            raise
        self._started = True
        self.load_seconds = max(ready.values())
        report(f"workers ready (model loaded and compiled in {self.load_seconds:.1f} s)")

    @property
    def config(self) -> Mapping[str, Any]:
        return self.manifest.config

    def failure(self) -> str | None:
        """Why the workers stopped, or None while they serve."""
        if self._failure is None and not self._closed and not self._thread.is_alive():
            return "the worker processes exited"
        return self._failure

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int
                 ) -> GenerationResult:
        """``max_new_tokens`` greedy tokens for every prompt, in the caller's order, and the
        slowest rank's time per step."""
        checked = check_prompts(prompts, self.config, max_new_tokens)
        with self._lock:
            if self._closed:
                raise ServiceError("the service was closed; expected a running service")
            failure = self.failure()
            if failure is not None:
                raise ServiceError(f"the rank workers failed earlier: {failure}")
            self._next_id += 1
            request_id = self._next_id
            shares = split_prompts(checked, self.world_size)
            for rank, share in enumerate(shares):
                self._requests[rank].put((request_id, share, max_new_tokens))
            done = self._collect("done", request_id, GENERATION_TIMEOUT_S, "generating")
        return GenerationResult.from_ranks([done[r] for r in range(self.world_size)],
                                           len(checked), self.backend, self.placement)

    def _collect(self, kind: str, request_id: int | None, timeout_s: float,
                 doing: str) -> dict[int, Any]:
        """One ``kind`` reply per rank (for ``request_id``), failing when the workers stop."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            try:
                reply_kind, rank, payload = self._replies.get(timeout=_POLL_S)
            except queue_module.Empty:
                failure = self.failure()
                if failure is not None:
                    raise ServiceError(f"the rank workers failed while {doing}: {failure}"
                                       ) from None
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"the rank workers did not finish {doing} within {timeout_s:.0f} s "
                        f"(ranks done: {sorted(got)})"
                    ) from None
                continue
            if reply_kind != kind:
                continue
            if request_id is not None:
                reply_id, payload = payload
                if reply_id != request_id:
                    continue
            got[rank] = payload
        return got

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (they finish the batch they are on) and wait for them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for q in self._requests:
                q.put(None)
        self._thread.join(timeout=timeout_s)

    def __enter__(self) -> LMService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionRequest:
    """A checked ``/v1/completions`` body."""

    prompts: list[list[int]]
    max_tokens: int


# The OpenAI completion fields. Sampling fields are accepted only at the value that leaves
# greedy decoding unchanged; fields that would change the output's form are accepted only
# when absent or empty; anything else (a typo such as "max_token" included) is refused, so no
# request is silently answered differently from what it asked.
_NEUTRAL = {"temperature": 0, "top_p": 1, "n": 1, "best_of": 1, "presence_penalty": 0,
            "frequency_penalty": 0}
_EMPTY_ONLY = ("stream", "stream_options", "logprobs", "echo", "stop", "suffix", "logit_bias")
_FREE = ("model", "prompt", "max_tokens", "user", "seed")
_KNOWN = (*_FREE, *_NEUTRAL, *_EMPTY_ONLY)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_completion_request(body: Any, config: Mapping[str, Any], tokenizer: Any = None
                             ) -> CompletionRequest:
    """Check a ``/v1/completions`` JSON body against the model; token ids per prompt."""
    if not isinstance(body, dict):
        raise CompletionRequestError("the request body is not a JSON object; expected "
                                     '{"prompt": ..., "max_tokens": N}')
    unknown = sorted(set(body) - set(_KNOWN))
    if unknown:
        raise CompletionRequestError(
            f"unknown field(s) {', '.join(unknown)}; expected only OpenAI completion fields "
            f"({', '.join(_KNOWN)})", unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value):
            raise CompletionRequestError(f"{name} is {json.dumps(value)}; expected a number",
                                         name)
        if value != neutral:
            raise CompletionRequestError(
                f"{name} {json.dumps(value)} is not supported: this server decodes greedily, one "
                f"answer per prompt; expected {name} absent or {neutral}", name)
    for name in _EMPTY_ONLY:
        if body.get(name) not in (None, False, "", [], {}):
            raise CompletionRequestError(
                f"{name} is not supported by this server; expected it absent, false or empty",
                name)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise CompletionRequestError(
            f"max_tokens is {json.dumps(max_tokens)}; expected a positive integer", "max_tokens")
    prompts = _prompt_ids(body.get("prompt"), tokenizer)
    limit = int(config["max_position_embeddings"])
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > limit:
        raise CompletionRequestError(
            f"max_tokens {max_tokens} with a {longest}-token prompt exceeds the model's "
            f"{limit} positions; expected max_tokens at most {max(limit - longest, 0)}",
            "max_tokens" if longest < limit else "prompt")
    try:
        checked = check_prompts(prompts, config, max_tokens)
    except GenerationInputError as exc:
        raise CompletionRequestError(str(exc), "prompt") from None
    return CompletionRequest(checked, max_tokens)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_ids(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """The four OpenAI prompt forms: text, texts, token ids, lists of token ids."""
    expected = ("expected a string, a list of strings, a list of token ids or a list of lists "
                "of token ids")
    if prompt is None:
        raise CompletionRequestError(f"prompt is missing; {expected}", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list):
        raise CompletionRequestError(f"prompt is {json.dumps(prompt)}; {expected}", "prompt")
    if not prompt:
        raise CompletionRequestError(f"prompt is an empty list; {expected}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        if tokenizer is None:
            raise CompletionRequestError(
                "prompt is text but this server was started without a tokenizer; expected "
                "token ids", "prompt")
        out = []
        for i, text in enumerate(prompt):
            ids = tokenizer.encode(text).ids
            if not ids:
                raise CompletionRequestError(f"prompt {i} ({text!r}) encodes to no tokens; "
                                             "expected non-empty text", "prompt")
            out.append(list(ids))
        return out
    if all(isinstance(p, list) for p in prompt):
        for i, ids in enumerate(prompt):
            if not all(_is_token_id(t) for t in ids):
                raise CompletionRequestError(
                    f"prompt {i} holds values that are not token ids; expected integers",
                    "prompt")
        return [list(p) for p in prompt]
    if any(isinstance(p, (str, list)) for p in prompt):
        raise CompletionRequestError(f"prompt mixes texts, token ids and lists; {expected}",
                                     "prompt")
    if not all(_is_token_id(t) for t in prompt):
        raise CompletionRequestError("prompt holds values that are not token ids; expected "
                                     "integers", "prompt")
    return [list(prompt)]


def end_of_sequence_ids(config: Mapping[str, Any]) -> set[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        return set()
    return {int(t) for t in (eos if isinstance(eos, list) else [eos])}


def completion_choice(index: int, tokens: Sequence[int], eos: set[int], tokenizer: Any
                      ) -> dict[str, Any]:
    """One OpenAI choice: tokens up to (not including) the first end-of-sequence token."""
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    kept = list(tokens if stop is None else tokens[:stop])
    return {
        "index": index,
        "text": tokenizer.decode(kept) if tokenizer is not None else "",
        "token_ids": kept,
        "logprobs": None,
        "finish_reason": "length" if stop is None else "stop",
    }


# -- the HTTP application ---------------------------------------------------------------------


def build_app(service: LMService, model_name: str, tokenizer: Any = None) -> Any:
    """The FastAPI application serving ``service`` under ``model_name``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="numaov", version="1")
    app.router.redirect_slashes = False  # "/v1/completions/" is an error, not a redirect
    eos = end_of_sequence_ids(service.config)
    routes = "POST /v1/completions, GET /v1/models and GET /health"

    def error(status: int, message: str, param: str | None = None,
              kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(status_code=status, content={
            "error": {"message": message, "type": kind, "param": param, "code": None}})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths and methods, in the same error shape as everything else.
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; "
                     f"this server answers {routes}", None, kind)

    @app.get("/health")
    def health() -> Any:
        failure = service.failure()
        body = {"status": "ok" if failure is None else "failed", "model": model_name,
                "ranks": service.world_size, "backend": service.backend}
        if failure is not None:
            body["error"] = failure
            return JSONResponse(status_code=503, content=body)
        return body

    @app.get("/v1/models")
    def models() -> Any:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "numaov"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            return error(400, "the request body is not JSON; expected a JSON object")
        if isinstance(body, dict) and body.get("model") not in (None, model_name):
            return error(404, f"model {body.get('model')!r} is not served here; expected "
                         f"{model_name!r}", "model", "model_not_found")
        try:
            parsed = parse_completion_request(body, service.config, tokenizer)
        except CompletionRequestError as exc:
            return error(exc.status, str(exc), exc.param)
        try:  # generation blocks: off the event loop, so /health answers meanwhile
            result = await run_in_threadpool(service.generate, parsed.prompts, parsed.max_tokens)
        except ServiceError as exc:
            return error(503, str(exc), None, "server_error")
        choices = [completion_choice(i, t, eos, tokenizer) for i, t in enumerate(result.tokens)]
        prompt_tokens = sum(len(p) for p in parsed.prompts)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    return app


# -- the HTTP server --------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0 picks a free port); bind it before starting the
    workers, so a taken port fails in a second rather than after loading the model."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServiceError(f"cannot listen on {host}:{port} ({exc.strerror}); expected a free "
                           "port on a local address", parameter="port") from None
    return sock


def serve_forever(app: Any, sock: socket.socket,
                  notify: Callable[[str], None] | None = None) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until SIGINT or SIGTERM, then return.

    The first signal stops once the request in flight is answered (``notify`` is told so);
    a second one forces. SIGTERM is handled like Ctrl-C for the time of the call, so the
    caller's cleanup (closing the service and its workers) runs either way.
    """
    import uvicorn

    tell = notify or (lambda _msg: None)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            if not self.should_exit:  # the first signal drains; a second one forces
                tell("stopping once the request in flight is answered (again to force)")
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)

"""The HTTP service: OpenAI-style completions over the LM engine.

``LMService(model_dir)`` starts the engine (:class:`numaov.runtime.lm_engine.LMEngine`) on one
worker per rank of the binding plan, as ``numaov run deepseek`` does, but the workers stay:
each pins itself, joins the model's collective group, loads and compiles its rank's graph and
allocates its KV cache once, then serves steps until the service closes. Every request is
submitted to the engine on its own, so requests that arrive while others run join the running
batch at the next step (continuous batching) instead of waiting for them.

``build_app(service)`` is the FastAPI application; ``listen(host, port)`` binds its socket
(before the workers start, so a taken port fails at once) and ``serve_forever(app, sock)``
runs it with uvicorn until SIGINT or SIGTERM, as ``numaov serve`` does:

- ``GET /health``: ``{"status": "ok", ...}``, or HTTP 503 once the workers have failed;
  ``GET /stats``: the engine's queue depth, running sequences, cache use and tokens/s per rank.
- ``GET /v1/models``: the one model served.
- ``POST /v1/completions``: ``prompt`` as text, a list of texts (both need ``--tokenizer``), a
  list of token ids or a list of such lists; ``max_tokens`` (default 16); sampling per request:
  ``temperature`` (0 = greedy, the default), ``top_p``, ``top_k``, ``seed``; stop rules:
  ``stop`` (strings, need ``--tokenizer``), ``stop_token_ids``, ``ignore_eos``; ``logprobs``
  (0 or 1: the chosen tokens' log-probabilities); ``stream`` (server-sent events, one prompt;
  a client that goes away cancels its request). ``n`` > 1, ``echo``, ``suffix``, penalties and
  ``logit_bias`` are refused with HTTP 400 rather than ignored. Each choice carries ``text``
  (decoded when the server has a tokenizer, else empty) and ``token_ids``; ``finish_reason`` is
  "stop" (end-of-sequence token or a stop id, left out; or a stop string, the text cut before
  it) or "length".

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with HTTP 400 for
bad input, 404 for another model name, 503 when the workers are gone.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from numaov import NumaovError
from numaov.runtime.binding import BindingPlan
from numaov.runtime.lm_cache import DEFAULT_CACHE_TOKENS
from numaov.runtime.lm_engine import (
    GenerationInputError,
    GenerationResult,
    LMEngine,
    Progress,
    SamplingParams,
    check_prompts,
)
from numaov.runtime.lm_ranks import RankWorkersError
from numaov.runtime.lm_scheduler import DEFAULT_PREFILL_CHUNK

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16


class ServiceError(NumaovError):
    """The service's workers failed, stopped or did not start."""


class CompletionRequestError(NumaovError):
    """A completion request the service cannot run; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


# -- the service ------------------------------------------------------------------------------


class LMService:
    """The engine over long-lived rank workers for one exported DeepSeek-V2 model."""

    def __init__(self, model_dir: str | Path, backend: str = "openvino", *,
                 plan: BindingPlan | None = None, cache_tokens: int = DEFAULT_CACHE_TOKENS,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, tokenizer: Any = None,
                 progress: Progress = None) -> None:
        try:
            self.engine = LMEngine.start(model_dir, backend, plan=plan, cache_tokens=cache_tokens,
                                         tokenizer=tokenizer, prefill_chunk=prefill_chunk,
                                         progress=progress)
        except RankWorkersError as exc:
            raise ServiceError(str(exc)) from None
        self.backend = backend
        self.world_size = self.engine.world_size
        self.placement = self.engine.placement
        self.load_seconds = self.engine.load_seconds

    @property
    def config(self) -> Mapping[str, Any]:
        return self.engine.config

    def failure(self) -> str | None:
        """Why the workers stopped, or None while they serve."""
        return self.engine.failure()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 params: SamplingParams | None = None) -> GenerationResult:
        """Every prompt's completion (default: greedy, ``max_new_tokens`` at most), in the
        caller's order, and the engine's step times while they ran."""
        checked = check_prompts(prompts, self.config, max_new_tokens)
        params = params or SamplingParams(max_new_tokens)
        before = len(self.engine.step_seconds)
        try:
            completions = self.engine.generate(checked, params)
        except RankWorkersError as exc:
            raise ServiceError(str(exc)) from None
        self._raise_on_error(completions)
        return GenerationResult.from_engine(self.engine, completions, before)

    def _raise_on_error(self, completions: Sequence[Any]) -> None:
        if any(c.finish_reason == "error" for c in completions):
            raise ServiceError(f"the rank workers failed while generating: {self.failure()}")

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LMService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionRequest:
    """A checked ``/v1/completions`` body."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False

    @property
    def max_tokens(self) -> int:
        return self.params.max_new_tokens


# The OpenAI completion fields (and vLLM's top_k, stop_token_ids, ignore_eos). Fields numaov
# does not implement are accepted only at the value that changes nothing, or only when absent
# or empty; anything else (a typo such as "max_token" included) is refused, so no request is
# silently answered differently from what it asked.
_NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0}
_EMPTY_ONLY = ("stream_options", "echo", "suffix", "logit_bias")
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
             "logprobs", "stream")
_FREE = ("model", "prompt", "max_tokens", "user")
_KNOWN = (*_FREE, *_SAMPLING, *_NEUTRAL, *_EMPTY_ONLY)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sampling_params(body: dict[str, Any], max_tokens: int, tokenizer: Any) -> SamplingParams:
    """The request's sampling settings, each checked by SamplingParams (one message each)."""
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if stop and tokenizer is None:
        raise CompletionRequestError("stop strings need the text, but this server was started "
                                     "without a tokenizer; expected stop_token_ids", "stop")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, True, 0, 1):
        raise CompletionRequestError(
            f"logprobs is {json.dumps(logprobs)}; expected 0 or 1 (this server returns the "
            "chosen token's log-probability only)", "logprobs")
    settings: dict[str, Any] = {
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "top_k": body.get("top_k"), "seed": body.get("seed"),
        "stop_token_ids": body.get("stop_token_ids"), "ignore_eos": body.get("ignore_eos"),
    }
    settings = {k: v for k, v in settings.items() if v is not None}
    if "ignore_eos" in settings and not isinstance(settings["ignore_eos"], bool):
        raise CompletionRequestError(f"ignore_eos is {json.dumps(settings['ignore_eos'])}; "
                                     "expected true or false", "ignore_eos")
    try:
        return SamplingParams(max_tokens, stop=tuple(stop) if isinstance(stop, list) else stop,
                              logprobs=bool(logprobs), **settings)
    except GenerationInputError as exc:
        raise CompletionRequestError(str(exc), exc.parameter) from None


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
                f"{name} {json.dumps(value)} is not supported: this server gives one answer "
                f"per prompt, without penalties; expected {name} absent or {neutral}", name)
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
    params = _sampling_params(body, max_tokens, tokenizer)
    stream = body.get("stream")
    if stream not in (None, False, True):
        raise CompletionRequestError(f"stream is {json.dumps(stream)}; expected true or false",
                                     "stream")
    prompts = _prompt_ids(body.get("prompt"), tokenizer)
    if stream and len(prompts) > 1:
        raise CompletionRequestError("stream takes one prompt; expected a single prompt (or "
                                     "one request per prompt)", "stream")
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
    return CompletionRequest(checked, params, bool(stream))


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


def _logprobs(completion: Any, tokenizer: Any) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    pieces = [tokenizer.decode([t]) if tokenizer is not None else str(t)
              for t in completion.tokens]
    return {"tokens": pieces, "token_logprobs": completion.logprobs}


def completion_choice(index: int, completion: Any, tokenizer: Any) -> dict[str, Any]:
    """One OpenAI choice of a finished engine request."""
    return {
        "index": index,
        "text": completion.text,
        "token_ids": list(completion.tokens),
        "logprobs": _logprobs(completion, tokenizer),
        "finish_reason": completion.finish_reason,
    }


# -- the HTTP application ---------------------------------------------------------------------


def build_app(service: LMService, model_name: str, tokenizer: Any = None) -> Any:
    """The FastAPI application serving ``service`` under ``model_name``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="numaov", version="1")
    app.router.redirect_slashes = False  # "/v1/completions/" is an error, not a redirect
    engine = service.engine
    routes = "POST /v1/completions, GET /v1/models, GET /stats and GET /health"

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

    @app.get("/stats")
    def stats() -> Any:
        return engine.stats().as_dict()

    @app.get("/v1/models")
    def models() -> Any:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "numaov"}]}

    def header() -> dict[str, Any]:
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model_name}

    async def events(request: Request, request_id: int, head: dict[str, Any]):
        finished = False
        try:
            async for event in engine.astream(request_id):
                finished = event.finish_reason is not None
                choice = {"index": 0, "text": event.text, "token_ids": event.tokens,
                          "logprobs": ({"token_logprobs": event.logprobs} if event.logprobs
                                       else None),
                          "finish_reason": event.finish_reason}
                yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                if not finished and await request.is_disconnected():
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free the sequence's cache now
                engine.cancel(request_id)
            await run_in_threadpool(engine.result, request_id)  # finished: drop it

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
            ids = [engine.submit(p, parsed.params) for p in parsed.prompts]
        except CompletionRequestError as exc:
            return error(exc.status, str(exc), exc.param)
        except GenerationInputError as exc:  # e.g. larger than the whole cache
            return error(400, str(exc), exc.parameter)
        except RankWorkersError as exc:
            return error(503, str(exc), None, "server_error")
        if parsed.stream:
            return StreamingResponse(events(request, ids[0], header()),
                                     media_type="text/event-stream")
        # waiting blocks: off the event loop, so /health answers meanwhile
        done = [await run_in_threadpool(engine.result, i) for i in ids]
        if any(c.finish_reason == "error" for c in done):
            return error(503, f"the rank workers failed: {service.failure()}", None,
                         "server_error")
        choices = [completion_choice(i, c, tokenizer) for i, c in enumerate(done)]
        prompt_tokens = sum(len(p) for p in parsed.prompts)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {
            **header(),
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
        # listening from here on: a client that connects once the URL is printed waits in the
        # backlog until uvicorn accepts, instead of being refused
        sock.listen(128)
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

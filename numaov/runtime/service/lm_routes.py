"""``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /stats`` over the LM
engine (:class:`~numaov.runtime.service.lm_service.LMService`): parse the body
(:mod:`~numaov.runtime.service.lm_requests`), submit it, shape the answer.

Each choice of a request is one engine sequence, submitted on its own, so it joins the
running batch at the next step (continuous batching). The body is parsed (and its text
tokenized) off the event loop. Answers: a JSON body once every choice has finished, or
server-sent events (``stream``), one chunk per token, ending with ``data: [DONE]`` (and,
with ``stream_options.include_usage``, a last chunk carrying ``usage``). A chat choice's text
goes through a :class:`~numaov.runtime.service.chat_output.ChatAnswer` token by token in both
ways of answering (reasoning, content and tool calls split as the request's
``chat_output`` says), so a whole answer is exactly what its stream adds up to. A client that
goes away cancels its sequences: their cache slots are free at once.

Statuses: 400 for a bad body (naming the field) or a structure the model's vocabulary
cannot write (found when a choice reaches the dead end: streamed, an error event), 404 for another model, 413 for a body above the limit, 429 with ``Retry-After`` when the
queue is full, 503 (with ``Retry-After`` while they restart) when the rank workers fail.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from numaov.runtime.lm.engine import Completion, LMEngine, StreamEvent
from numaov.runtime.lm.ranks import RankWorkersError, RankWorkersRestarting
from numaov.runtime.lm.sequence import GenerationInputError
from numaov.runtime.service.chat_output import ChatAnswer
from numaov.runtime.service.chat_template import ChatTemplate
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.http_common import (
    Route,
    ServiceOptions,
    error_response,
    read_model_request,
    wait_for_disconnect,
)
from numaov.runtime.service.lm_requests import (
    LMRequest,
    parse_chat_request,
    parse_completion_request,
)
from numaov.runtime.service.metrics import ServiceMetrics

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RETRY_AFTER_S = 1


@dataclass
class LMRoutes:
    """The LM's routes and the state they share."""

    ROUTES = (Route("POST", COMPLETIONS, "completions"), Route("POST", CHAT, "chat"),
              Route("GET", "/stats", "stats", kind="info"))

    engine: LMEngine
    model_name: str
    tokenizer: Any
    template: ChatTemplate
    options: ServiceOptions
    metrics: ServiceMetrics
    failure: Callable[[], str | None]

    # -- submitting -----------------------------------------------------------------------

    def submit(self, parsed: LMRequest) -> list[int]:
        """Every choice's sequence, in choice order (prompt-major); 429 when the queue is
        full, 503 when the workers are down. Nothing is left submitted on a refusal."""
        count = len(parsed.prompts) * parsed.n
        waiting = self.engine.stats().queue_depth
        if waiting + count > self.options.max_queue:
            raise RequestError(
                f"the queue is full ({waiting} requests waiting, at most "
                f"{self.options.max_queue}); expected a retry after {RETRY_AFTER_S} s", None,
                429, kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        ids: list[int] = []
        try:
            for i, (prompt, params) in enumerate(zip(parsed.prompts, parsed.params,
                                                     strict=True)):
                for choice in params:
                    ids.append(self.engine.submit(prompt, choice, name=f"prompt {i}"))
        except BaseException as exc:
            self.drop(ids)
            if isinstance(exc, GenerationInputError):  # the engine's checks: the prompt's ids
                # and stop ids against the model, a request larger than the whole cache
                param = parsed.prompt_param if exc.parameter == "prompt" else exc.parameter
                raise RequestError(str(exc), param) from None
            if isinstance(exc, RankWorkersRestarting):
                raise RequestError(str(exc), None, 503, kind="server_error",
                                   headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            if isinstance(exc, RankWorkersError):
                raise RequestError(str(exc), None, 503, kind="server_error") from None
            raise
        return ids

    def drop(self, ids: list[int]) -> None:
        """Cancel what still runs and take every result (never blocks: cancel finishes)."""
        for request_id in ids:
            self.engine.cancel(request_id)
            try:
                self.engine.result(request_id)
            except GenerationInputError:  # taken already
                pass

    def failed(self, parsed: LMRequest, structure_error: str | None = None) -> RequestError:
        """A choice ended with finish reason "error": its structure could not go on (the
        request's own failure, 400: trying again gives the same) or the workers failed."""
        structured = parsed.params[0][0].structured
        if structure_error is not None and structured is not None:
            return RequestError(structure_error, structured.parameter)
        return RequestError(f"the rank workers failed while generating: {self.failure()}; "
                            "expected a retry once /health is ok", None, 503,
                            kind="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    # -- answers --------------------------------------------------------------------------

    def header(self, chat: bool, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat \
            else "text_completion"
        prefix = "chatcmpl" if chat else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.model_name}

    def pieces(self, tokens: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)
                for t in tokens]

    def chat_logprobs(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
        return {"content": [{"token": piece, "logprob": value,
                             "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                            for piece, value in zip(self.pieces(tokens), logprobs,
                                                    strict=True)]}

    def completion_logprobs(self, tokens: list[int], logprobs: list[float],
                            offset: int = 0) -> dict[str, Any]:
        """The completions ``logprobs`` object, every field OpenAI's has: the chosen tokens
        are their own top 1; ``text_offset`` counts characters from ``offset`` (where these
        tokens' text starts in the choice's text)."""
        pieces = self.pieces(tokens)
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": pieces, "token_logprobs": logprobs,
                "top_logprobs": [{piece: value} for piece, value in zip(pieces, logprobs,
                                                                         strict=True)],
                "text_offset": offsets}

    def completion_choice(self, index: int, done: Completion) -> dict[str, Any]:
        logprobs = None
        if done.logprobs is not None:
            logprobs = self.completion_logprobs(done.tokens, done.logprobs)
        return {"index": index, "text": done.text, "token_ids": list(done.tokens),
                "logprobs": logprobs, "finish_reason": done.finish_reason}

    def chat_choice(self, index: int, done: Completion, answer: ChatAnswer,
                    logprobs: bool) -> dict[str, Any]:
        return {"index": index, "message": answer.message(),
                "logprobs": (self.chat_logprobs(done.tokens, done.logprobs or [])
                             if logprobs else None),
                "finish_reason": answer.finish_reason(done.finish_reason)}

    @staticmethod
    def usage(parsed: LMRequest, generated: int, cached: int,
              answers: list[ChatAnswer] | None = None) -> dict[str, Any]:
        """OpenAI's ``usage``; ``cached``: prompt tokens read from the prefix cache."""
        prompt = sum(len(p) for p in parsed.prompts)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": generated,
                                 "total_tokens": prompt + generated,
                                 "prompt_tokens_details": {"cached_tokens": cached}}
        if parsed.chat_output.reasoning is not None and answers:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(a.reasoning_tokens for a in answers)}
        return usage

    # -- the two ways of answering --------------------------------------------------------

    async def whole(self, request: Request, parsed: LMRequest, ids: list[int], chat: bool,
                    endpoint: str, arrived: float) -> Any:
        first = {"seen": False}
        answers = [ChatAnswer(parsed.chat_output) for _ in ids] if chat else []

        async def finish(index: int, request_id: int) -> Completion:
            async for event in self.engine.astream(request_id):
                if event.tokens and not first["seen"]:
                    first["seen"] = True
                    self.metrics.first_token.labels(endpoint).observe(
                        time.perf_counter() - arrived)
                if chat:  # the same pieces a stream would give its parser
                    answers[index].add(len(event.tokens), event.text,
                                       last=event.finish_reason is not None)
            return self.engine.result(request_id)

        everything = asyncio.ensure_future(asyncio.gather(*(finish(i, r)
                                                            for i, r in enumerate(ids))))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():  # the client went away: free its sequences now
            everything.cancel()
            self.drop(ids)
            return None
        gone.cancel()
        done = everything.result()
        broken = [c for c in done if c.finish_reason == "error"]
        if broken:
            return error_response(self.failed(parsed, next(
                (c.structure_error for c in broken if c.structure_error), None)))
        choices = [self.chat_choice(i, c, answers[i], parsed.logprobs) if chat
                   else self.completion_choice(i, c) for i, c in enumerate(done)]
        return {**self.header(chat), "choices": choices,
                "usage": self.usage(parsed, sum(len(c.tokens) for c in done),
                                    sum(c.cached_tokens for c in done), answers)}

    async def events(self, parsed: LMRequest, ids: list[int], chat: bool, endpoint: str,
                     arrived: float) -> AsyncIterator[str]:
        head = self.header(chat, chunk=True)
        usage_field = {"usage": None} if parsed.include_usage else {}
        merged: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()

        async def pump(index: int, request_id: int) -> None:
            async for event in self.engine.astream(request_id):
                await merged.put((index, event))

        def chunk(choices: list[dict[str, Any]]) -> str:
            return f"data: {json.dumps({**head, 'choices': choices, **usage_field})}\n\n"

        async def single() -> AsyncIterator[tuple[int, StreamEvent]]:
            # one choice (the usual case): its events as they come, without a task between
            async for event in self.engine.astream(ids[0]):
                yield 0, event

        async def several() -> AsyncIterator[tuple[int, StreamEvent]]:
            while True:
                yield await merged.get()

        tasks = ([asyncio.ensure_future(pump(i, r)) for i, r in enumerate(ids)]
                 if len(ids) > 1 else [])
        events = several() if tasks else single()
        generated, open_choices, first = 0, len(ids), False
        offsets = [0] * len(ids)  # each choice's text so far, in characters
        answers = [ChatAnswer(parsed.chat_output) for _ in ids] if chat else []
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in range(len(ids))])
            async for index, event in events:
                if event.finish_reason == "error":
                    failed = self.failed(parsed, event.structure_error)
                    yield f"data: {json.dumps(failed.body())}\n\n"
                    return
                if event.tokens and not first:
                    first = True
                    self.metrics.first_token.labels(endpoint).observe(
                        time.perf_counter() - arrived)
                generated += len(event.tokens)
                if chat:
                    answer = answers[index]
                    delta = answer.add(len(event.tokens), event.text,
                                       last=event.finish_reason is not None)
                    if delta or (parsed.logprobs and event.tokens):
                        yield chunk([{"index": index, "delta": delta,
                                      "logprobs": (self.chat_logprobs(event.tokens,
                                                                      event.logprobs)
                                                   if parsed.logprobs else None),
                                      "finish_reason": None}])
                    if event.finish_reason is not None:
                        yield chunk([{"index": index, "delta": {}, "logprobs": None,
                                      "finish_reason": answer.finish_reason(
                                          event.finish_reason)}])
                else:
                    logprobs = None
                    if event.logprobs:  # (only then are the offsets asked for)
                        logprobs = self.completion_logprobs(event.tokens, event.logprobs,
                                                            offsets[index])
                        offsets[index] += sum(len(p) for p in logprobs["tokens"])
                    yield chunk([{"index": index, "text": event.text,
                                  "token_ids": event.tokens, "logprobs": logprobs,
                                  "finish_reason": event.finish_reason}])
                if event.finish_reason is not None:
                    open_choices -= 1
                    if not open_choices:
                        break
            if parsed.include_usage:  # every choice finished: their completions are there
                cached = sum(self.engine.result(r).cached_tokens for r in ids)
                usage = self.usage(parsed, generated, cached, answers)
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # finished, failed, or the client went away: nothing is left running
            # No await here: a cancelled response (the client went away) could be cancelled
            # again at it, before the sequences are dropped. The event iterators are closed
            # by the event loop's async-generator finalizer.
            self.drop(ids)
            for task in tasks:
                task.cancel()

    # -- the routes -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Any:
        return await self.answer(request, chat=False)

    async def chat(self, request: Request) -> Any:
        return await self.answer(request, chat=True)

    def stats(self) -> Any:
        return self.engine.stats().as_dict()

    async def answer(self, request: Request, chat: bool) -> Any:
        from fastapi.responses import StreamingResponse
        from starlette.concurrency import run_in_threadpool

        arrived = time.perf_counter()
        endpoint = CHAT if chat else COMPLETIONS
        try:
            body = await read_model_request(request, self.options.max_body_bytes,
                                            self.model_name)
            if chat:
                parsed = await run_in_threadpool(parse_chat_request, body, self.engine.config,
                                                 self.tokenizer, self.template,
                                                 self.options.limits, self.options.chat)
            else:
                parsed = await run_in_threadpool(parse_completion_request, body,
                                                 self.engine.config, self.tokenizer,
                                                 self.options.limits)
            ids = self.submit(parsed)
        except RequestError as exc:
            return error_response(exc)
        if parsed.stream:
            return StreamingResponse(self.events(parsed, ids, chat, endpoint, arrived),
                                     media_type="text/event-stream")
        return await self.whole(request, parsed, ids, chat, endpoint, arrived)

"""Request bodies are parsed off the event loop: a large body's parse must not hold up the
other requests the server is answering (``/health`` above all). Shown without timing: the
parse waits until a coroutine on the loop has run, which it could not if the parse held the
loop; test_service_video.py refuses 4 MB bodies on a real server while polling ``/health``."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from starlette.requests import Request

from numaov.runtime.service import http_common

HANG_GUARD_S = 30  # only a hang guard: the event is set within milliseconds when it works


def _request(body: bytes) -> Request:
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    return Request(scope, receive)


def test_the_json_parse_leaves_the_event_loop_free(monkeypatch: pytest.MonkeyPatch) -> None:
    loop_ran = threading.Event()
    parse_threads: list[int] = []
    real_parse = http_common.parse_json

    def gated_parse(data: bytes) -> object:
        parse_threads.append(threading.get_ident())
        # Held until the loop has run the ticker below: on the loop's own thread this wait
        # could never end (the ticker would wait behind it), so it returns False.
        assert loop_ran.wait(HANG_GUARD_S), "the parse held the event loop"
        return real_parse(data)

    monkeypatch.setattr(http_common, "parse_json", gated_parse)
    body = {"prompt": "w1 " * 100_000, "max_tokens": 1}

    async def main() -> object:
        async def ticker() -> None:  # sets the event once the parse is under way
            while not parse_threads:
                await asyncio.sleep(0.001)
            loop_ran.set()

        parsed, _ = await asyncio.gather(
            http_common.read_json(_request(json.dumps(body).encode()), 8_000_000), ticker())
        return parsed

    assert asyncio.run(main()) == body
    assert parse_threads and parse_threads[0] != threading.get_ident()

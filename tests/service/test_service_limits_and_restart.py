"""`numaov serve` under bad input, limits, a full queue, a dying worker and SIGTERM: a real
server process (the tiny DeepSeek-V2, dp=2) with an API key (from NUMAOV_API_KEY), a small
body limit, one running sequence per rank and a queue of one. The tests run in file order on
one server: the last one stops it with SIGTERM while a request is in flight."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from support.service_harness import STOP_S, shared_memory_of, start_server, stop_server

pytestmark = pytest.mark.slow  # a real server with rank workers on the exported tiny model

KEY = "sk-test-0123"
BODY_LIMIT = 4096
LONG = {"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(deepseek_exported: dict[str, Any], deepseek_bind: str):
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind, "--max-queue",
                               "1", "--max-running", "1", "--max-body-bytes", str(BODY_LIMIT),
                               env={"NUMAOV_API_KEY": KEY})
    client = httpx.Client(base_url=url, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"})
    state = {"url": url, "client": client, "server": server, "stopped": False}
    try:
        yield state
    finally:
        client.close()
        if not state["stopped"]:
            stop_server(server)


def _wait(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _serves(client: httpx.Client) -> list[int]:
    response = client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 3})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _error(response: httpx.Response, status: int, param: str | None, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and re.search(message, error["message"]), error


def test_the_key_is_required_except_on_health_and_metrics(served) -> None:
    url = served["url"]
    _error(httpx.post(f"{url}/v1/completions", json={"prompt": [1]}), 401, None,
           "needs an API key")
    _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": []},
                      headers={"Authorization": "Bearer wrong"}), 401, None, "Bearer <key>")
    _error(httpx.get(f"{url}/v1/models", headers={"Authorization": KEY}), 401, None, "API key")
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200
    assert 'numaov_requests_total{endpoint="/v1/completions",status="401"} 1.0' in metrics.text
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
                     ).status_code == 200


@pytest.mark.parametrize(("content", "status", "param", "message"), [
    (b"{not json", 400, None, "not JSON"),
    (b'{"prompt": [1, 2], "max_tokens": "8"}', 400, "max_tokens", "expected a positive integer"),
    (b'{"prompt": [1, 2], "temperature": [1]}', 400, "temperature", "expected a number"),
    (b'{"prompt": {"a": 1}}', 400, "prompt", "expected a string"),
    (b'{"prompt": [1], "model": "gpt-4o"}', 404, "model", "not served here"),
    (b'{"prompt": [' + b"1, " * 2000 + b"1]}", 413, None, f"larger than {BODY_LIMIT} bytes"),
])
def test_bad_bodies_get_their_4xx_and_the_server_keeps_serving(served, content: bytes,
                                                                status: int, param: str | None,
                                                                message: str) -> None:
    client = served["client"]
    _error(client.post("/v1/completions", content=content,
                       headers={"content-type": "application/json"}), status, param, message)
    _serves(client)


def test_an_oversize_body_without_a_length_is_refused_while_it_arrives(served) -> None:
    def chunks():
        yield b'{"prompt": ['
        for _ in range(100):
            yield b"1, " * 50
        yield b"1]}"

    _error(served["client"].post("/v1/completions", content=chunks(),
                                 headers={"content-type": "application/json"}), 413, None,
           "the server's body limit")
    _serves(served["client"])


def _stats(client: httpx.Client) -> dict[str, Any]:
    return client.get("/stats").json()


def _start_on_both_ranks(call, client: httpx.Client) -> list[threading.Thread]:
    """Two long requests, one per rank; the second is sent once the first runs (with a queue
    of one, a request not yet admitted at the next step counts as waiting)."""
    threads = []
    for running in ([1, 0], [1, 1]):
        threads.append(threading.Thread(target=call))
        threads[-1].start()
        _wait(lambda r=running: sorted(_stats(client)["running"], reverse=True) == r,
              f"running {running}")
    return threads


def test_a_full_queue_is_a_429_with_retry_after(served) -> None:
    client = served["client"]
    answers: list[httpx.Response] = []

    def ask(body: dict[str, Any]) -> None:
        answers.append(client.post("/v1/completions", json=body))

    # one running sequence per rank (--max-running 1), then one waiting (--max-queue 1)
    runners = _start_on_both_ranks(lambda: ask(LONG), client)
    waiting = threading.Thread(target=ask, args=({"prompt": [9], "max_tokens": 2},))
    waiting.start()
    _wait(lambda: _stats(client)["queue_depth"] == 1, "a waiting request")
    full = client.post("/v1/completions", json={"prompt": [9], "max_tokens": 2})
    _error(full, 429, None, r"the queue is full \(1 requests waiting, at most 1\)")
    assert full.headers["retry-after"] == "1"
    assert full.json()["error"]["type"] == "rate_limit_error"
    for t in [*runners, waiting]:
        t.join(timeout=120)
    assert [r.status_code for r in answers] == [200, 200, 200]
    _serves(client)


def _generated(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return float(re.search(r"^numaov_generated_tokens_total (\S+)$", text, re.M).group(1))


def test_a_client_that_goes_away_cancels_its_sequence(served) -> None:
    client = served["client"]
    before = _generated(client)
    with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # closed after its first token: the sequence leaves the batch long before 240 tokens
    _wait(lambda: sum(_stats(client)["running"]) == 0, "the stream's sequence to leave", 30)
    assert _generated(client) - before < LONG["max_tokens"] / 2
    assert sum(_stats(client)["cache_used_tokens"]) == 0


def _health(client: httpx.Client) -> httpx.Response:
    return client.get("/health")


def test_a_killed_worker_fails_its_requests_and_the_group_restarts(served) -> None:
    client, server = served["client"], served["server"]
    expected = _serves(client)
    old = _health(client).json()["lm"]["workers"]
    answers: list[httpx.Response] = []
    threads = _start_on_both_ranks(
        lambda: answers.append(client.post("/v1/completions", json=LONG)), client)
    os.kill(old[1]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    # Which rank reports first is a race: the killed one's exit, or its peer's failed step.
    blamed = r"rank process died without a result \(.*rank 1 exit code -9|rank 0 failed"
    for response in answers:
        _error(response, 503, None, rf"the rank workers failed while generating: .*({blamed})")
        assert response.headers["retry-after"] == "1"
    # degraded while the fresh group starts, then ok with the restart counted
    states = []
    _wait(lambda: states.append(_health(client)) or states[-1].status_code == 200,
          "health to be ok again", 120)
    assert any(s.status_code == 503 and s.json()["status"] == "restarting" for s in states)
    health = states[-1].json()["lm"]
    assert health["restarts"] == 1 and health["state"] == "ok"
    assert re.search(blamed, health["failures"][-1]["error"]), health["failures"]
    new = health["workers"]
    assert [w["rank"] for w in new] == [0, 1]
    assert all(w["state"] == "running" and w["restarts"] == 1 for w in new)
    assert {w["pid"] for w in new}.isdisjoint({w["pid"] for w in old})
    assert not any(os.path.exists(f"/proc/{w['pid']}") and "Z" not in open(
        f"/proc/{w['pid']}/stat").read().rsplit(")", 1)[1].split()[0] for w in old)
    assert _serves(client) == expected
    assert shared_memory_of(server.proc.pid) == []
    assert "numaov_worker_restarts_total 1.0" in client.get("/metrics").text


def test_a_second_crash_soon_after_backs_off(served) -> None:
    client = served["client"]
    _wait(lambda: _health(client).status_code == 200, "health ok", 120)
    pid = _health(client).json()["lm"]["workers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)  # idle: the engine notices without a request
    seen = []
    _wait(lambda: seen.append(_health(client).json()) or (
        seen[-1]["status"] == "ok" and seen[-1]["lm"]["restarts"] == 2), "restart 2", 120)
    waits = [s["lm"]["restart_in_s"] for s in seen if s["lm"]["restart_in_s"] is not None]
    assert waits and max(waits) > 0.2  # the second restart within a minute waited (1 s)
    assert len(seen[-1]["lm"]["failures"]) == 2
    _serves(client)


def test_sigterm_drains_the_request_in_flight_and_leaves_no_shared_memory(served) -> None:
    client, server = served["client"], served["server"]
    answers: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: answers.append(
        client.post("/v1/completions", json=LONG)))
    runner.start()
    _wait(lambda: sum(_stats(client)["running"]) == 1, "a request in flight")
    server.proc.send_signal(signal.SIGTERM)
    runner.join(timeout=120)
    served["stopped"] = True
    output = server.rest_of_output(STOP_S)
    assert server.proc.returncode == 0 and "Traceback" not in output, output
    assert answers[0].status_code == 200, answers[0].text
    assert len(answers[0].json()["choices"][0]["token_ids"]) == LONG["max_tokens"]
    assert shared_memory_of(server.proc.pid) == []

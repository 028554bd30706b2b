"""`numaov serve`: a real HTTP server (the CLI, started as a process) over two pinned rank
workers serving the tiny DeepSeek-V2 exported for dp=2, checked against the PyTorch dp=1
references, for every prompt form, concurrent clients, bad requests and shutdown."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.deepseek_harness import (
    CLI,
    MAX_NEW_TOKENS,
    SCENARIOS,
    greedy_reference,
    tiny_tokenizer,
)
from support.service_harness import STARTUP_S, STOP_S, children, start_server, stop_server

from numaov.models.deepseek_v2 import DeepseekV2
from numaov.runtime.lm.sequence import SamplingParams
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.lm_requests import parse_completion_request

pytestmark = pytest.mark.slow  # a real server with rank workers on the exported tiny model

MODEL_NAME = "tiny-deepseek"


@pytest.fixture(scope="module")
def served(deepseek_exported: dict[str, Any], deepseek_bind: str, tmp_path_factory):
    tok_dir = tmp_path_factory.mktemp("tokenizer")
    tokenizer = tiny_tokenizer(tok_dir)
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind, "--tokenizer",
                               str(tok_dir), "--model-name", MODEL_NAME)
    client = httpx.Client(base_url=url, timeout=120)
    try:
        yield {"url": url, "client": client, "tokenizer": tokenizer, "server": server,
               "exported": deepseek_exported}
    finally:
        client.close()
        stop_server(server)


def _expected_choice(tokens: list[int], eos: int = 1) -> tuple[list[int], str]:
    """The served form of generated tokens: cut before the first end-of-sequence token."""
    if eos in tokens:
        return tokens[: tokens.index(eos)], "stop"
    return tokens, "length"


def test_completions_with_token_ids_match_torch_dp1(served) -> None:
    references = served["exported"]["references"]
    for name, prompts in SCENARIOS.items():
        body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": MAX_NEW_TOKENS}
        if name == "one":  # also the flat form: one prompt as a list of ids
            body["prompt"] = prompts[0]
        response = served["client"].post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["object"] == "text_completion" and answer["model"] == MODEL_NAME
        assert [c["index"] for c in answer["choices"]] == list(range(len(prompts)))
        generated = 0
        for choice, tokens in zip(answer["choices"], references[name][0], strict=True):
            kept, reason = _expected_choice(list(tokens))
            assert choice["token_ids"] == kept
            assert choice["finish_reason"] == reason
            assert choice["text"] == served["tokenizer"].decode(kept)
            generated += len(kept)
        assert answer["usage"] == {
            "prompt_tokens": sum(map(len, prompts)), "completion_tokens": generated,
            "total_tokens": sum(map(len, prompts)) + generated,
            "prompt_tokens_details": {"cached_tokens": 0}}  # prompts shorter than a block


def test_text_prompts_go_through_the_tokenizer(served) -> None:
    tokenizer = served["tokenizer"]
    texts = ["the cat sat on a mat", "hello world"]
    response = served["client"].post("/v1/completions", json={"prompt": texts, "max_tokens": 4})
    assert response.status_code == 200, response.text
    model = DeepseekV2.from_pretrained(served["exported"]["checkpoint"])
    expected, _ = greedy_reference(model, [tokenizer.encode(t).ids for t in texts], 4)
    for choice, tokens in zip(response.json()["choices"], expected, strict=True):
        kept, _ = _expected_choice(list(tokens))
        assert choice["token_ids"] == kept
        assert choice["text"] == tokenizer.decode(kept)


def test_concurrent_clients_each_get_their_own_answer(served) -> None:
    # Different prompts and lengths at once: requests queue for the workers, none is mixed up.
    prompts = SCENARIOS["three"] + [[9, 8, 7], [400, 401, 402, 403, 404, 405]]
    client = served["client"]

    def ask(i: int) -> list[int]:
        response = client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 5})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, range(len(prompts))))
    one_by_one = [ask(i) for i in range(len(prompts))]
    assert together == one_by_one
    model = DeepseekV2.from_pretrained(served["exported"]["checkpoint"])
    expected, _ = greedy_reference(model, prompts, 5)
    assert together == [_expected_choice(list(t))[0] for t in expected]


def test_models_and_health(served, deepseek_bind: str) -> None:
    client = served["client"]
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
    assert client.get(f"/v1/models/{MODEL_NAME}").json() == client.get("/v1/models").json(
        )["data"][0]
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    # a prompt past the model's positions: OpenAI's code for it
    long = client.post("/v1/completions", json={"prompt": [3] * 100000, "max_tokens": 1})
    assert long.status_code == 400
    assert long.json()["error"]["code"] == "context_length_exceeded", long.text
    health = client.get("/health")
    assert health.status_code == 200
    body = health.json()
    assert {k: body[k] for k in ("status", "model", "ranks", "backend")} == {
        "status": "ok", "model": MODEL_NAME, "ranks": 2, "backend": "openvino"}
    workers = body["lm"]["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    assert all(w["state"] == "running" and w["restarts"] == 0 for w in workers)
    assert [w["cpus"] for w in workers] == [[int(c)] for c in deepseek_bind.split("|")]
    assert all(Path(f"/proc/{w['pid']}").exists() for w in workers)
    stats = client.get("/stats").json()
    assert len(stats["running"]) == len(stats["cache_used_tokens"]) == 2
    assert stats["cache_capacity_tokens"][0] > 0 and stats["queue_depth"] >= 0


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"prompt": [1, 2], "temperature": -0.5}, 400, "temperature", "expected a number >= 0"),
    ({"prompt": [1, 2], "temperature": 100}, 400, "temperature", "expected a number from 0 to 2"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p", r"expected a number in \(0, 1\]"),
    ({"prompt": [1, 2], "top_k": -1}, 400, "top_k", "expected an integer >= 0"),
    ({"prompt": [1, 2], "seed": "x"}, 400, "seed", "expected an integer"),
    ({"prompt": [1, 2], "logprobs": 5}, 400, "logprobs", "expected 0 or 1"),
    ({"prompt": [1, 2], "stop_token_ids": [1, 900]}, 400, "stop_token_ids",
     "outside the vocabulary"),
    ({"prompt": [1, 2], "n": 17}, 400, "n", "expected an integer from 1 to 16"),
    ({"prompt": [1, 2], "stream": "yes"}, 400, "stream", "expected true or false"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options",
     "expected stream: true"),
    ({"prompt": [1, 2], "presence_penalty": 0.5}, 400, "presence_penalty", "without penalties"),
    ({"prompt": [1, 2], "max_tokens": "4"}, 400, "max_tokens", "expected a positive integer"),
    ({"prompt": [1, 2], "temperature": "0"}, 400, "temperature", "expected a number"),
    ({"prompt": [1, 2], "logit_bias": {"5": -100}}, 400, "logit_bias", "not supported"),
    ({"prompt": [1, 2], "max_token": 3}, 400, "max_token", "unknown field"),
    ({"max_tokens": 2}, 400, "prompt", "prompt is missing"),
    ({"prompt": []}, 400, "prompt", "prompt is an empty list"),
    ({"prompt": 5}, 400, "prompt", "prompt is 5; expected a string"),
    ({"prompt": [[1, 2], "a"]}, 400, "prompt", "mixes texts"),
    ({"prompt": [1.5, 2]}, 400, "prompt", "not token ids"),
    ({"prompt": [1, 600]}, 400, "prompt", r"token id\(s\) \[600\] outside the vocabulary"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens", "expected a positive integer"),
    ({"prompt": [1], "stop_token_ids": [-1]}, 400, "stop_token_ids", r"is \[-1\];"),
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options", "include_usage is \"yes\""),
    ({"model": 123, "prompt": [1]}, 400, "model", "model is 123; expected the model's name"),
    ({"prompt": [1, 2], "max_tokens": 100000}, 400, "max_tokens",
     r"expected max_tokens at most \d+"),
    ({"model": "gpt-4", "prompt": [1]}, 404, "model", "not served here"),
    ([1, 2], 400, None, "not a JSON object"),
    # the word-level vocabulary has no "{": the request's own failure, no worker's
    ({"prompt": "the cat", "max_tokens": 4, "response_format": {"type": "json_object"}}, 400,
     "response_format", "json_object cannot start: .* model's vocabulary"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    served, body: Any, status: int, param: str | None, message: str
) -> None:
    client = served["client"]
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and re.search(message, error["message"]), error
    assert "retry-after" not in response.headers
    assert client.post("/v1/completions", json={"prompt": [3], "max_tokens": 1}).status_code == 200


def test_neutral_openai_fields_are_accepted(served) -> None:
    # What OpenAI clients send by default or as no-ops; max_tokens null means the default (16).
    body = {"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": None, "temperature": 0,
            "top_p": 1.0, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "stop": [],
            "stream": False, "logit_bias": {}, "user": "someone", "seed": 4}
    response = served["client"].post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert len(choice["token_ids"]) == 16 or choice["finish_reason"] == "stop"


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/completions", 405),
    ("POST", "/v1/embeddings", 404),
    ("POST", "/v1/completions/", 404),
])
def test_other_routes_get_openai_errors_naming_the_routes(served, method: str, path: str,
                                                          status: int) -> None:
    response = served["client"].request(method, path, json={"prompt": [1]})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"  # OpenAI's, for unknown paths too
    assert ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
            "GET /v1/models/{model}, GET /health, "
            "GET /metrics and GET /stats" in error["message"])


def test_a_body_that_is_not_json_is_a_400(served) -> None:
    response = served["client"].post("/v1/completions", content=b"{not json",
                                     headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not JSON" in response.json()["error"]["message"]


def test_text_prompt_without_a_tokenizer_says_to_start_with_one() -> None:
    config = {"vocab_size": 512, "max_position_embeddings": 64}
    with pytest.raises(RequestError, match="started without a tokenizer; expected "
                       "token ids"):
        parse_completion_request({"prompt": "hello"}, config, None)
    assert parse_completion_request({"prompt": [[4, 5], [6]], "max_tokens": 3}, config
                                    ).prompts == [[4, 5], [6]]
    with pytest.raises(RequestError, match="without a tokenizer; expected "
                       "stop_token_ids"):
        parse_completion_request({"prompt": [4], "stop": "\n"}, config, None)
    parsed = parse_completion_request({"prompt": [4], "temperature": 0.5, "seed": 3,
                                       "top_k": 4, "logprobs": 1, "stop_token_ids": [7]}, config)
    assert parsed.params == [[SamplingParams(16, temperature=0.5, seed=3, top_k=4, logprobs=True,
                                           stop_token_ids=(7,))]]
    # logprobs 0 is the chosen tokens' too (as vLLM's); false or absent is none
    for value, wanted in ((0, True), (False, False), (None, False)):
        parsed = parse_completion_request({"prompt": [4], "logprobs": value}, config)
        assert parsed.params[0][0].logprobs is wanted, value


def _stream(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):])["choices"][0])
    return chunks


def test_streaming_yields_exactly_the_final_text(served) -> None:
    client = served["client"]
    body = {"prompt": "the cat sat on a mat", "max_tokens": 6, "temperature": 0.9, "seed": 11,
            "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = _stream(client, body)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert [v for c in chunks for v in (c["logprobs"] or {}).get("token_logprobs", [])] == (
        whole["logprobs"]["token_logprobs"])
    # OpenAI's whole logprobs object: the chosen tokens as their own top 1, text offsets
    logprobs = whole["logprobs"]
    assert logprobs["top_logprobs"] == [{t: v} for t, v in zip(
        logprobs["tokens"], logprobs["token_logprobs"], strict=True)]
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i])
                                       for i in range(len(logprobs["tokens"]))]
    assert [v for c in chunks for v in (c["logprobs"] or {}).get("text_offset", [])] == (
        logprobs["text_offset"])
    assert chunks[-1]["finish_reason"] == whole["finish_reason"] is not None


def test_seeded_sampling_gives_the_same_tokens_alone_and_among_others(served) -> None:
    client = served["client"]
    sampled = {"prompt": [9, 8, 7], "max_tokens": 6, "temperature": 1.0, "top_p": 0.9,
               "seed": 5, "ignore_eos": True}
    alone = client.post("/v1/completions", json=sampled).json()["choices"][0]["token_ids"]
    others = [{"prompt": [30 + i] * (i + 1), "max_tokens": 4 + i, "temperature": 0.8,
               "seed": i} for i in range(4)]
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda b: client.post("/v1/completions", json=b).json(),
                                [*others, sampled]))
    assert answers[-1]["choices"][0]["token_ids"] == alone
    assert len(alone) == 6


def test_serve_errors_are_one_line_and_fast(deepseek_exported, deepseek_bind: str,
                                            tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [*CLI, "serve", "--model-dir", str(deepseek_exported["model_dir"]), "--port",
             str(port)], capture_output=True, text=True, timeout=120,
            env={**os.environ, "NUMAOV_CPU_BIND": deepseek_bind})
        assert time.monotonic() - start < 60  # refused before any worker starts
    assert proc.returncode != 0
    # The library's error names the parameter; the CLI puts its flag in front.
    assert f"numaov: error: --port: cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([*CLI, "serve", "--model-dir", str(tmp_path / "missing"), "--port",
                           "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert str(tmp_path / "missing") in proc.stderr


def test_a_worker_failing_at_startup_is_one_line(deepseek_exported, deepseek_bind: str) -> None:
    # The setting is read where each rank compiles its graph: inside the worker processes.
    proc = subprocess.run(
        [*CLI, "serve", "--model-dir", str(deepseek_exported["model_dir"]), "--port", "0",
         "--quiet"], capture_output=True, text=True, timeout=STARTUP_S,
        env={**os.environ, "NUMAOV_CPU_BIND": deepseek_bind, "NUMAOV_ATTENTION": "flash"})
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"numaov: error: the rank workers failed while starting: rank \d failed: "
                        r"NUMAOV_ATTENTION='flash' is not a known setting.*", lines[0]), lines


def test_killed_server_leaves_no_worker_behind(deepseek_exported, deepseek_bind: str) -> None:
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind)
    workers = children(server.proc.pid)
    assert workers, "the server has no child processes"
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 2},
                      timeout=120).status_code == 200
    server.proc.kill()
    server.proc.wait(timeout=STOP_S)
    deadline = time.monotonic() + STOP_S
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.2)
    alive = [p for p in workers if Path(f"/proc/{p}").exists()
             and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]]
    assert not alive, f"worker processes {alive} outlived the killed server"

"""`numaov serve` as users call it: the official `openai` client against a real server
process over the tiny DeepSeek-V2 (dp=2), with the chat template of its tokenizer directory.

Greedy answers are checked against the PyTorch model (no cache at all, `greedy_reference`);
streamed answers against the same request answered whole; sampled answers against the same
request run alone (a sequence's tokens do not depend on what shares its batch)."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from support.deepseek_harness import greedy_reference
from support.service_harness import chat_tokenizer, start_server, stop_server

from numaov.models.deepseek_v2 import DeepseekV2
from numaov.runtime.service.chat_template import load_chat_template

pytestmark = pytest.mark.slow  # a real server with rank workers on the exported tiny model

MODEL = "tiny-chat"
EOS = 1  # the tiny model's eos_token_id


@pytest.fixture(scope="module")
def served(deepseek_exported: dict[str, Any], deepseek_bind: str, tmp_path_factory):
    import openai

    tok_dir = tmp_path_factory.mktemp("chat_tokenizer")
    tokenizer = chat_tokenizer(tok_dir)
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind, "--tokenizer",
                               str(tok_dir), "--model-name", MODEL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield {"url": url, "client": client, "tokenizer": tokenizer, "tok_dir": tok_dir,
               "model": DeepseekV2.from_pretrained(deepseek_exported["checkpoint"]),
               "server": server}
    finally:
        client.close()
        output = stop_server(server)
        assert f"chat template: {tok_dir}/tokenizer_config.json" in output


def _cut(tokens: list[int]) -> tuple[list[int], str]:
    return (tokens[:tokens.index(EOS)], "stop") if EOS in tokens else (tokens, "length")


def _chat_ids(served, messages: list[dict[str, str]]) -> list[int]:
    return load_chat_template([served["tok_dir"]]).encode(served["tokenizer"], messages)


MESSAGES = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "a cat"}]


def test_chat_matches_torch_on_the_templated_prompt(served) -> None:
    answer = served["client"].chat.completions.create(model=MODEL, messages=MESSAGES,
                                                      max_tokens=6)
    ids = _chat_ids(served, MESSAGES)
    expected, _ = greedy_reference(served["model"], [ids], 6)
    kept, reason = _cut(expected[0])
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == served["tokenizer"].decode(kept)
    assert choice.finish_reason == reason
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.usage.completion_tokens == len(kept)
    assert answer.usage.total_tokens == len(ids) + len(kept)


def test_completion_through_the_client_matches_torch(served) -> None:
    tokenizer = served["tokenizer"]
    answer = served["client"].completions.create(model=MODEL, prompt="the cat sat",
                                                 max_tokens=5)
    expected, _ = greedy_reference(served["model"], [tokenizer.encode("the cat sat").ids], 5)
    kept, reason = _cut(expected[0])
    assert answer.choices[0].text == tokenizer.decode(kept)
    assert answer.choices[0].finish_reason == reason
    assert answer.usage.completion_tokens == len(kept)


def test_streamed_chat_equals_the_whole_answer(served) -> None:
    client = served["client"]
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 8,
            "temperature": 0.9, "seed": 21, "logprobs": True}
    whole = client.chat.completions.create(**body)
    texts, reasons, logprobs, usage, chunks = {}, {}, {}, None, 0
    for chunk in client.chat.completions.create(**body, stream=True,
                                                stream_options={"include_usage": True}):
        chunks += 1
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []  # usage comes on a last chunk of its own
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend(t.logprob for t in c.logprobs.content)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert chunks > 3
    assert texts == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason}
    assert logprobs[0] == [t.logprob for t in whole.choices[0].logprobs.content]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_differ_and_each_repeats_with_its_seed(served) -> None:
    client = served["client"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0,
            "seed": 5, "n": 3}
    first = client.chat.completions.create(**body)
    again = client.chat.completions.create(**body)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # seeds 5, 6, 7
    # choice j samples with seed + j: choice 1 is the single answer with seed 6
    alone = client.chat.completions.create(**{**body, "n": 1, "seed": 6})
    assert alone.choices[0].message.content == texts[1]
    other = client.chat.completions.create(**{**body, "n": 1, "seed": 99})
    assert other.choices[0].message.content != texts[0] or texts[0] == ""
    completions = client.completions.create(model=MODEL, prompt=["the cat", "hello world"],
                                            max_tokens=4, n=2, temperature=0.8, seed=1)
    assert [c.index for c in completions.choices] == [0, 1, 2, 3]


def test_stop_strings_end_the_text_before_them(served) -> None:
    client = served["client"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0,
            "seed": 3}
    free = client.chat.completions.create(**body).choices[0].message.content
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    cut = client.chat.completions.create(**body, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == free[:free.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **body, stop=stop, stream=True) if c.choices)
    assert streamed == cut.message.content


def test_models_lists_the_model(served) -> None:
    assert [m.id for m in served["client"].models.list().data] == [MODEL]


def _request(kind: str, i: int) -> dict[str, Any]:
    """One of 12 distinct requests: completions and chats, greedy and seeded, streamed or
    not."""
    words = ["the cat", "a mat", "hello world", "w20 w21 w22"]
    sampled = {"temperature": 0.9, "seed": 100 + i} if i % 2 else {}
    if kind == "completion":
        return {"model": MODEL, "prompt": words[i % 4], "max_tokens": 3 + i % 5, **sampled}
    return {"model": MODEL, "max_tokens": 3 + i % 6, **sampled,
            "messages": [{"role": "user", "content": words[(i + 1) % 4]}]}


def _ask(client: httpx.Client, kind: str, i: int, stream: bool) -> str:
    body = _request(kind, i)
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    if not stream:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"] if kind == "completion" else choice["message"]["content"]
    text = ""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    for line in lines[:-1]:
        for c in json.loads(line[6:])["choices"]:
            text += c["text"] if kind == "completion" else c["delta"].get("content") or ""
    return text


def test_bounded_concurrent_load_answers_every_request_as_alone(served) -> None:
    # 48 requests, 12 at a time, completions and chats, streamed and not, greedy and seeded:
    # every answer equals the same request answered alone, and none is lost.
    jobs = [(kind, i, stream) for kind in ("completion", "chat") for i in range(6)
            for stream in (False, True)]
    with httpx.Client(base_url=served["url"], timeout=120) as client:
        alone = {(k, i): _ask(client, k, i, False) for k, i, _ in jobs}
        load = jobs * 2
        random.Random(7).shuffle(load)
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda job: _ask(client, *job), load))
        assert len(answers) == 48
        for (kind, i, stream), text in zip(load, answers, strict=True):
            assert text == alone[(kind, i)], (kind, i, stream)
        metrics = client.get("/metrics").text
    done = re.search(r'numaov_requests_total\{endpoint="/v1/chat/completions",status="200"\} '
                     r"(\d+)", metrics)
    assert done and int(done.group(1)) >= 36
    assert re.search(r'numaov_time_to_first_token_seconds_count\{endpoint="/v1/completions"\} '
                     r"[1-9]", metrics)
    for name in ("numaov_queue_depth", 'numaov_running_sequences{rank="1"}',
                 'numaov_cache_capacity_tokens{rank="0"}', 'numaov_worker_busy_seconds_total'
                 '{rank="0"}', "numaov_worker_restarts_total 0.0", "numaov_generated_tokens"):
        assert name in metrics, name


def test_a_repeated_system_prompt_is_read_from_the_prefix_cache(served) -> None:
    """A conversation resending a long system prompt and its history: later turns report the
    prompt tokens read from the cache (usage.prompt_tokens_details.cached_tokens), whole and
    streamed, and answer as the PyTorch model does with no cache at all; /metrics counts them."""
    from numaov.runtime.lm.cache import PREFIX_BLOCK

    client, tokenizer = served["client"], served["tokenizer"]
    system = {"role": "system", "content": " ".join(f"w{10 + i % 400}" for i in range(50))}
    messages = [system, {"role": "user", "content": "a cat"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "the mat"}]
    ids = _chat_ids(served, messages)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    # at least the system prompt's whole blocks came from the first turn
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 50 // PREFIX_BLOCK * PREFIX_BLOCK and cached % PREFIX_BLOCK == 0
    assert cached < len(ids)
    expected, _ = greedy_reference(served["model"], [ids], 4)
    assert second.choices[0].message.content == tokenizer.decode(_cut(expected[0])[0])
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        second.choices[0].message.content)
    metrics = httpx.get(f"{served['url']}/metrics").text
    hits = [float(v) for v in re.findall(r'numaov_cached_prompt_tokens_total\{rank="\d"\} (\S+)',
                                         metrics)]
    assert len(hits) == 2 and sum(hits) >= 2 * cached
    assert re.search(r'numaov_prefix_cache_hit_rate\{rank="\d"\} 0\.[1-9]', metrics)

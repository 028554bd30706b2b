"""Tool calls and reasoning through a real `numaov serve --reasoning-parser qwen3
--tool-call-parser hermes` over the tiny DeepSeek-V2 (dp=2), with the official `openai`
client, as agents use it.

The tiny model writes nothing of the kind by itself, so the server's tokenizer is scripted
(`service_harness.scripted_tokenizer`): for the user messages the harness picks, the model's
greedy tokens decode to a Qwen-style tool call and to a `<think>` block followed by an
answer. Whole answers and streams of the same request must agree."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.deepseek_harness import greedy_reference
from support.service_harness import Script, scripted_tokenizer, start_server, stop_server

from numaov.models.deepseek_v2 import DeepseekV2
from numaov.runtime.service.chat_template import load_chat_template

pytestmark = pytest.mark.slow  # a real server with rank workers on the exported tiny model

MODEL = "tiny-agent"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL_PIECES = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":',
               '"Paris"}}', "</tool_call>"]
THINK_PIECES = ["<think>", "pondering", "deeply", "</think>", "Hello", "there"]


@pytest.fixture(scope="module")
def served(deepseek_exported: dict[str, Any], deepseek_bind: str, tmp_path_factory):
    import openai

    model = DeepseekV2.from_pretrained(deepseek_exported["checkpoint"])
    tok_dir = tmp_path_factory.mktemp("scripted_tokenizer")
    # The server's default is thinking off; the reasoning request turns it on.
    calling = Script(CALL_PIECES, tools=[WEATHER], template_kwargs={"enable_thinking": False})
    thinking = Script(THINK_PIECES, template_kwargs={"enable_thinking": True})
    tokenizer = scripted_tokenizer(tok_dir, model, [calling, thinking])
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind, "--tokenizer",
                               str(tok_dir), "--model-name", MODEL, "--reasoning-parser",
                               "qwen3", "--tool-call-parser", "hermes",
                               "--chat-template-kwargs", '{"enable_thinking": false}')
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield {"client": client, "tokenizer": tokenizer, "tok_dir": tok_dir, "model": model,
               "calling": calling, "thinking": thinking}
    finally:
        client.close()
        output = stop_server(server)
        assert "reasoning parser qwen3; tool-call parser hermes" in output


def _streamed(client, **body) -> dict[str, Any]:
    """The stream added up as an agent adds it; the kinds of delta in the order they came."""
    out: dict[str, Any] = {"content": "", "reasoning_content": "", "calls": {}, "kinds": []}
    for chunk in client.chat.completions.create(**body, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning = (delta.model_extra or {}).get("reasoning_content")
            for kind, text in (("reasoning", reasoning), ("content", delta.content)):
                if text:
                    out["kinds"].append(kind)
                    out[f"{kind}_content" if kind == "reasoning" else kind] += text
            for call in delta.tool_calls or []:
                out["kinds"].append("tool_call")
                entry = out["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                entry["id"] = call.id or entry.get("id")
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                out["finish_reason"] = choice.finish_reason
    return out


def test_a_tool_call_comes_back_as_tool_calls_whole_and_streamed(served) -> None:
    client, script = served["client"], served["calling"]
    body = {"model": MODEL, "messages": script.messages, "tools": [WEATHER],
            "max_tokens": len(CALL_PIECES)}
    answer = client.chat.completions.create(**body)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert (choice.message.model_extra or {}).get("reasoning_content") is None  # thinking off
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert answer.usage.completion_tokens == len(CALL_PIECES)
    stream = _streamed(client, **body)
    assert stream["finish_reason"] == "tool_calls"
    assert stream["content"] == "" and stream["kinds"] == ["tool_call"]
    assert [(c["name"], c["arguments"]) for c in stream["calls"].values()] == \
        [(call.function.name, call.function.arguments)]
    assert stream["usage"].completion_tokens == len(CALL_PIECES)

    # The agent's next turn: the answer echoed back as the client sends it (content null),
    # then the tool's result; the prompt is the history rendered by the server's template.
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    follow = client.chat.completions.create(
        model=MODEL, messages=[*script.messages, choice.message, result], tools=[WEATHER],
        max_tokens=2)
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.function.arguments}}]}
    expected = load_chat_template([served["tok_dir"]]).encode(
        served["tokenizer"], [*script.messages, echoed, result], [WEATHER],
        {"enable_thinking": False})
    assert follow.usage.prompt_tokens == len(expected)


def test_reasoning_comes_back_apart_from_the_content_whole_and_streamed(served) -> None:
    client, script = served["client"], served["thinking"]
    body = {"model": MODEL, "messages": script.messages, "max_tokens": len(THINK_PIECES),
            "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    answer = client.chat.completions.create(**body)
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == " pondering deeply "
    assert message.content == " Hello there"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens_details.reasoning_tokens == 4
    stream = _streamed(client, **body)
    assert stream["reasoning_content"] == " pondering deeply "
    assert stream["content"] == " Hello there"
    # " pondering", " deeply", " </think>" (its space), " Hello", " there": no tag leaks
    assert stream["kinds"] == ["reasoning"] * 3 + ["content"] * 2
    assert stream["usage"].completion_tokens_details.reasoning_tokens == 4

    # Without the request's chat_template_kwargs the server's default (thinking off) holds:
    # the whole answer is content, whatever the model writes.
    plain = client.chat.completions.create(model=MODEL, messages=script.messages,
                                           max_tokens=4)
    ids = load_chat_template([served["tok_dir"]]).encode(
        served["tokenizer"], script.messages, None, {"enable_thinking": False})
    tokens = greedy_reference(served["model"], [ids], 4, eos=1)[0][0]  # 1: the end token
    assert plain.choices[0].message.model_extra["reasoning_content"] is None
    assert plain.choices[0].message.content == served["tokenizer"].decode(tokens)
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0

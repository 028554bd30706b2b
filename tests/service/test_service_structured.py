"""Structured outputs through a real `numaov serve` over the tiny DeepSeek-V2 (dp=2) with the
official `openai` client: `response_format` JSON Schema (also through
`client.chat.completions.parse` and a pydantic model) and JSON object, vLLM's
`structured_outputs` forms, and `tool_choice` "required" / a named function forced through the
grammar, whole and streamed, with a two-turn tool round trip. The server speaks the byte-level
tokenizer of `support.json_tokenizer` (the tiny model's 512 ids), in which JSON can be
written; the model's free text is not JSON."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from support.json_tokenizer import json_tokenizer
from support.service_harness import start_server, stop_server

pytestmark = pytest.mark.slow  # a real server with rank workers on the exported tiny model

MODEL = "tiny-json"
ASK = [{"role": "user", "content": "The cat sat on the mat"}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "status": {"enum": ["open", "closed", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"city": {"enum": ["paris", "tokyo", "london"]},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["city", "age"], "additionalProperties": False},
    },
    "required": ["name", "status", "tags", "owner"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["paris", "tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}}


class Owner(BaseModel):
    city: Literal["paris", "tokyo", "london"]
    age: int = Field(ge=0, le=120)


class Ticket(BaseModel):
    status: Literal["open", "closed", "pending"]
    owner: Owner
    tags: list[Literal["red", "green", "blue"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def served(deepseek_exported: dict[str, Any], deepseek_bind: str, tmp_path_factory):
    import openai

    tok_dir = tmp_path_factory.mktemp("json_tokenizer")
    json_tokenizer(tok_dir)
    server, url = start_server(deepseek_exported["model_dir"], deepseek_bind, "--tokenizer",
                               str(tok_dir), "--model-name", MODEL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield {"client": client}
    finally:
        client.close()
        stop_server(server)


def test_json_schema_answers_validate_where_free_text_is_not_json(served) -> None:
    client = served["client"]
    free = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA,
                                                  "strict": True}}
    for extra in ({}, {"temperature": 1.0, "seed": 4}):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200,
                                                response_format=fmt, **extra)
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, response_format=fmt, stream=True))
    assert streamed == client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, response_format=fmt).choices[0].message.content
    # the client's parse: a pydantic model's strict schema, the answer read back into it
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=200,
                                           response_format=Ticket)
    assert isinstance(parsed.choices[0].message.parsed, Ticket)
    # completions take response_format too, and vLLM's structured_outputs
    small = {"type": "object", "properties": {"city": {"enum": ["paris", "tokyo"]},
                                              "ok": {"type": "boolean"}},
             "required": ["city", "ok"], "additionalProperties": False}
    completion = client.completions.create(model=MODEL, prompt="The cat", max_tokens=60,
                                           extra_body={"response_format": {
                                               "type": "json_schema",
                                               "json_schema": {"name": "s", "schema": small}}})
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), small)
    choice = client.completions.create(model=MODEL, prompt="The cat", max_tokens=10,
                                       extra_body={"structured_outputs": {
                                           "choice": ["paris", "tokyo"]}})
    assert choice.choices[0].text in ("paris", "tokyo")
    # a budget too small for the document: "length", the document's beginning
    short = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                           response_format=fmt)
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content.startswith("{")


def test_tool_choice_required_and_named_always_give_calls_that_parse(served) -> None:
    client = served["client"]
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = named.choices[0].message.tool_calls
    # OpenAI's finish reason for the function a named tool_choice forced
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    # one call (parallel_tool_calls false: an array of one); the tiny model, free to go on,
    # adds calls until max_tokens cuts the array
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=120,
                                              parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls"
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for one in calls:
        jsonschema.validate(json.loads(one.function.arguments),
                            tools[one.function.name]["function"]["parameters"])
    # streamed: the same calls
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice="required", max_tokens=120,
                                                parallel_tool_calls=False, stream=True):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed.append((delta_call.function.name, delta_call.function.arguments))
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]
    # the second turn: the calls and their results go back, and the model answers
    results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    follow = client.chat.completions.create(
        model=MODEL, messages=[*ASK, required.choices[0].message, *results],
        tools=[WEATHER, TIME], tool_choice="none", max_tokens=5)
    assert follow.choices[0].message.tool_calls is None
    assert follow.usage.prompt_tokens > required.usage.prompt_tokens


def test_bad_structures_are_400s_naming_the_field(served) -> None:
    import openai

    client = served["client"]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs",
         "unclosed group"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                             "function": {"name": "nope"}}},
         "tool_choice", "not among the tools"),
    ]
    for body, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **body)
        assert caught.value.body["param"] == param

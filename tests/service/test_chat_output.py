"""Chat answers split into reasoning, content and tool calls (vLLM's qwen3 / deepseek_r1
reasoning parsers and hermes / deepseek_v3 tool-call parsers): whole answers, streams cut at
every place (the deltas add up to the whole answer), tags split across deltas, and calls that
do not parse."""

from __future__ import annotations

import json
import random

import pytest

from numaov import NumaovError
from numaov.runtime.service.chat_output import (
    TOOL_CALL_SYNTAX,
    ChatAnswer,
    ChatOutputFormat,
    ForcedCalls,
    check_parser_tags,
    reasoning_starts_open,
)

HERMES = TOOL_CALL_SYNTAX["hermes"]
DEEPSEEK = TOOL_CALL_SYNTAX["deepseek_v3"]
REASONING = ChatOutputFormat(reasoning="deepseek_r1", starts_in_reasoning=True)
TOOLS = ChatOutputFormat(tool_calls=HERMES)
BOTH = ChatOutputFormat(reasoning="qwen3", starts_in_reasoning=True, tool_calls=HERMES)
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
DEEPSEEK_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris"}\n```<｜tool▁call▁end｜>')


def whole(output: ChatOutputFormat, text: str, engine_reason: str = "stop") -> dict:
    answer = ChatAnswer(output)
    answer.add(1, text, last=True)
    return {**answer.message(), "finish_reason": answer.finish_reason(engine_reason)}


def streamed(output: ChatOutputFormat, pieces: list[str]) -> dict:
    """The stream's deltas added up as a client adds them (tool calls by index)."""
    answer = ChatAnswer(output)
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for i, piece in enumerate(pieces + [""]):  # an engine's last event may bring no text
        delta = answer.add(1, piece, last=i == len(pieces))
        assert set(delta) <= {"content", "reasoning_content", "tool_calls"}
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            assert call["index"] not in message["tool_calls"]  # one delta per call
            message["tool_calls"][call["index"]] = {k: v for k, v in call.items()
                                                    if k != "index"}
    calls = [message["tool_calls"][i] for i in range(len(message["tool_calls"]))]
    assert calls == [c.as_dict() for c in answer.tool_calls]
    return {"role": "assistant", "content": message["content"],
            "reasoning_content": message["reasoning_content"], "tool_calls": calls,
            "finish_reason": answer.finish_reason("stop")}


def same_answer(whole_message: dict, stream: dict) -> None:
    for name in ("content", "reasoning_content"):
        assert (whole_message.get(name) or "") == stream[name], name
    assert [dict(c, id=None) for c in whole_message.get("tool_calls", [])] == \
        [dict(c, id=None) for c in stream["tool_calls"]]
    assert whole_message["finish_reason"] == stream["finish_reason"]


def cuts(text: str, seed: int) -> list[list[str]]:
    """The text one character at a time, and cut at random places."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    return [list(text), [text[i:j] for i, j in zip([0, *at], [*at, len(text)], strict=True)]]


CASES = [
    # (format, output text, expected message fields)
    (REASONING, "<think>\nplan\n</think>\n\nanswer",
     {"reasoning_content": "\nplan\n", "content": "\n\nanswer"}),
    (REASONING, "plan</think>answer",  # DeepSeek-R1: <think> was in the prompt
     {"reasoning_content": "plan", "content": "answer"}),
    (REASONING, "  <think>plan", {"reasoning_content": "plan", "content": None}),  # cut off
    (REASONING, "plan <b>x</b> </thin", {"reasoning_content": "plan <b>x</b> </thin",
                                          "content": None}),
    (REASONING, "</think>", {"reasoning_content": None, "content": None}),
    (ChatOutputFormat(reasoning="qwen3", starts_in_reasoning=False), "no </think> here",
     {"reasoning_content": None, "content": "no </think> here"}),
    (TOOLS, f"Let me look.\n{WEATHER}",
     {"content": "Let me look.", "calls": [("get_weather", {"city": "Paris", "unit": "°C"})]}),
    (TOOLS, f"{WEATHER}\n{TIME}",
     {"content": None, "calls": [("get_weather", {"city": "Paris", "unit": "°C"}),
                                 ("get_time", {})]}),
    (TOOLS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off
     {"content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
      "calls": []}),
    (TOOLS, '<tool_call>{"name": "get_time", "arguments": {}}',  # unclosed, but whole
     {"content": None, "calls": [("get_time", {})]}),
    (TOOLS, '<tool_call>\n{name: get_weather}\n</tool_call> then text',  # not JSON
     {"content": '<tool_call>\n{name: get_weather}\n</tool_call> then text', "calls": []}),
    (TOOLS, '<tool_call>{"name": "x", "arguments": "a string"}</tool_call>',
     {"content": '<tool_call>{"name": "x", "arguments": "a string"}</tool_call>',
      "calls": []}),
    (TOOLS, f"<tool_call>[1]</tool_call>\n{TIME}",  # one bad call, one good one
     {"content": "<tool_call>[1]</tool_call>", "calls": [("get_time", {})]}),
    (TOOLS, "a < b and <tool", {"content": "a < b and <tool", "calls": []}),
    (TOOLS, "  plain answer \n", {"content": "  plain answer \n", "calls": []}),
    (ChatOutputFormat(tool_calls=DEEPSEEK),
     f"Sure.<｜tool▁calls▁begin｜>{DEEPSEEK_CALL}\n{DEEPSEEK_CALL}<｜tool▁calls▁end｜>",
     {"content": "Sure.", "calls": [("get_weather", {"city": "Paris"})] * 2}),
    (ChatOutputFormat(tool_calls=DEEPSEEK),
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     {"content": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops}\n```"
                 "<｜tool▁call▁end｜>", "calls": []}),
    (BOTH, f"<think>\nweather, so a tool\n</think>\n\n{WEATHER}",
     {"reasoning_content": "\nweather, so a tool\n", "content": None,
      "calls": [("get_weather", {"city": "Paris", "unit": "°C"})]}),
]


@pytest.mark.parametrize(("output", "text", "expected"), CASES)
def test_answers_whole_and_streamed_at_every_cut(output: ChatOutputFormat, text: str,
                                                 expected: dict) -> None:
    message = whole(output, text)
    for name in ("content", "reasoning_content"):
        if name in expected:
            assert message[name] == expected[name], name
    calls = expected.get("calls", [])
    got = message.get("tool_calls", [])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] \
        == calls
    for call in got:
        assert call["type"] == "function" and call["id"].startswith("call_")
    assert len({c["id"] for c in got}) == len(got)
    assert message["finish_reason"] == ("tool_calls" if calls else "stop")
    if calls and output.tool_calls is HERMES:  # arguments re-written as JSON, as vLLM does
        assert got[0]["function"]["arguments"] == json.dumps(calls[0][1], ensure_ascii=False)
    for pieces in cuts(text, seed=len(text)):
        same_answer(message, streamed(output, pieces))


def test_plain_answers_stay_as_generated() -> None:
    assert whole(ChatOutputFormat(), "") == {"role": "assistant", "content": "",
                                             "finish_reason": "stop"}
    assert whole(ChatOutputFormat(), " x <think>") == {"role": "assistant",
                                                      "content": " x <think>",
                                                      "finish_reason": "stop"}


def test_reasoning_deltas_come_before_content_and_tags_never_leak() -> None:
    answer = ChatAnswer(REASONING)
    deltas = [answer.add(1, piece) for piece in ["<th", "ink>", "a", "</", "thi", "nk>", "b"]]
    deltas.append(answer.add(0, "", last=True))
    assert deltas == [{}, {}, {"reasoning_content": "a"}, {}, {}, {}, {"content": "b"}, {}]
    assert answer.reasoning_tokens == 6  # generated while the reasoning was open


def test_where_the_answer_starts() -> None:
    # Qwen3 with enable_thinking false: the template closes an empty block in the prompt
    assert not reasoning_starts_open("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                                     {})
    assert not reasoning_starts_open("qwen3", "assistant\n", {"enable_thinking": False})
    assert reasoning_starts_open("deepseek_r1", "assistant\n", {"enable_thinking": False})
    assert reasoning_starts_open("deepseek_r1", "<｜Assistant｜><think>\n", {})
    assert reasoning_starts_open("qwen3", "</think> earlier turn\nassistant\n", {})


def test_a_tokenizer_that_drops_the_tags_is_refused(tmp_path) -> None:
    from support.service_harness import template_tokenizer

    tokenizer = template_tokenizer(tmp_path, "qwen3")
    check_parser_tags(tokenizer, "qwen3", "reasoning_parser")
    check_parser_tags(tokenizer, "hermes", "tool_call_parser")
    with pytest.raises(NumaovError, match="needs the tag '<｜tool▁calls▁begin｜>'") as e:
        check_parser_tags(tokenizer, "deepseek_v3", "tool_call_parser")
    assert e.value.parameter == "tool_call_parser"
    with pytest.raises(NumaovError, match="has no tokenizer"):
        check_parser_tags(None, "qwen3", "reasoning_parser")


def test_forced_calls_are_read_from_the_json_the_grammar_forced() -> None:
    named = ChatOutputFormat(forced=ForcedCalls("get_weather"))
    args = '{"city":"Paris"}'
    for pieces in cuts(args, 3)[:5]:
        stream = streamed(named, pieces)
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in stream["tool_calls"]] == [("get_weather", args)]
        assert stream["content"] == "" and stream["finish_reason"] == "stop"  # as OpenAI's
    message = whole(named, args)
    assert message["content"] is None and message["finish_reason"] == "stop"
    # a named call cut off by max_tokens keeps the arguments written so far, as vLLM's, and
    # says "length": they do not parse
    cut = whole(named, '{"city":"Pa', "length")
    assert cut["tool_calls"][0]["function"]["arguments"] == '{"city":"Pa'
    assert cut["finish_reason"] == "length"
    required = ChatOutputFormat(forced=ForcedCalls(None))
    calls = ('[{"name":"get_weather","parameters":{"city":"Paris"}},'
             '{"name":"get_time","parameters":{}}]')
    message = whole(required, calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"}),
                                                ("get_time", {})]
    same_answer(message, streamed(required, cuts(calls, 1)[0]))
    # a cut-off array is no call: it stays content
    cut = whole(required, calls[:30])
    assert cut["content"] == calls[:30] and "tool_calls" not in cut
    assert cut["finish_reason"] == "stop"

"""Chat prompts: the model directory's template rendered as transformers'
``apply_chat_template`` renders it (same text, same token ids), the plain template, and the
published Qwen3 and DeepSeek-V3 templates with tools, tool calls and results and
``chat_template_kwargs``; how a chat request decides how its answer is read."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.deepseek_harness import tiny_tokenizer
from support.service_harness import CHAT_TEMPLATE as TEMPLATE
from support.service_harness import (
    TEMPLATE_SPECIAL,
    chat_tokenizer,
    published_template,
    template_tokenizer,
)

from numaov.runtime.service.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)
from numaov.runtime.service.errors import RequestError
from numaov.runtime.service.lm_requests import ChatOptions, parse_chat_request

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": " a cat "},
            {"role": "assistant", "content": "on a mat"}, {"role": "user", "content": "w40"}]
CONFIG = {"vocab_size": 512, "max_position_embeddings": 64}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    chat_tokenizer(tmp_path)
    return tmp_path


def test_the_template_renders_and_tokenizes_as_transformers_does(model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"),
                                        bos_token="the", eos_token="mat",
                                        chat_template=TEMPLATE)
    template = load_chat_template([None, model_dir])
    assert not template.plain
    text = template.render(MESSAGES)
    assert text == reference.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                 tokenize=False)
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True)
    if hasattr(expected, "keys"):  # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert template.encode(tokenizer, MESSAGES) == list(expected)
    parsed = parse_chat_request({"messages": MESSAGES, "max_tokens": 3}, CONFIG, tokenizer,
                                template)
    assert parsed.prompts == [list(expected)] and parsed.max_tokens == 3


def test_a_template_error_is_a_400_on_messages(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    template = load_chat_template([model_dir])
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with pytest.raises(ChatTemplateError, match="refused the messages: unknown role tool") as e:
        parse_chat_request({"messages": [{"role": "tool", "content": "x",
                                          "tool_call_id": "call_1"}]}, CONFIG, tokenizer,
                           template)
    assert e.value.param == "messages" and e.value.status == 400


def test_without_a_template_the_plain_one_is_used(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tiny_tokenizer(tmp_path)
    template = load_chat_template([tmp_path, None])
    assert template.plain
    assert template.render(MESSAGES[:2]) == "system: w10 w11\nuser:  a cat \nassistant:"
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert template.encode(tokenizer, MESSAGES[:1]) == tokenizer.encode(
        "system: w10 w11\nassistant:").ids


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"messages": []}, "messages", "expected a list of"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "expected one of system"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "expected text"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "not text"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs",
     "chosen token's log-probability only"),
    ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
     "max_completion_tokens", "expected a positive integer"),
    ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 500},
     "max_completion_tokens", "expected max_completion_tokens at most"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     "tools", "expected a list of"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [TOOL]}, "tools",
     "this server has none; expected tool_choice \"none\""),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "auto"}, "tool_choice",
     "there are no tools"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": [1]},
     "chat_template_kwargs", "expected an object"),
    ({"messages": [{"role": "user", "content": "a"}],
      "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "sets 'add_generation_prompt', which the server gives the chat template itself"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages",
     "tool_call_id is null; expected the id of the call"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages",
     "content is null and the message calls no tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages", r"tool_calls\[0\] is .*expected a list of"),
    ({"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, "messages",
     r"\(user\) has field\(s\) tool_calls"),
    ({"messages": [{"role": "assistant", "content": "a", "refusal": "no"}]}, "messages",
     "refusal is not supported"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json"}},
     "response_format", "type 'json' is not known; expected text, json_object or json_schema"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}}, "structured_outputs",
     "response_format and structured_outputs each ask for a structure"),
    ({"messages": [{"role": "user", "content": "a"}],
      "structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs",
     "expected an object with exactly one of json, json_object, regex, choice, grammar"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}, "temperature",
     "expected a number"),
])
def test_bad_chat_bodies_name_the_field(tmp_path: Path, body: dict, param: str,
                                        message: str) -> None:
    from tokenizers import Tokenizer

    tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    with pytest.raises(RequestError, match=message) as e:
        parse_chat_request(body, CONFIG, tokenizer, load_chat_template([tmp_path]))
    assert e.value.param == param and e.value.status == 400


# -- the published Qwen3 and DeepSeek-V3 templates, with tools and template variables ----

PUBLISHED_CONFIG = {"vocab_size": 512, "max_position_embeddings": 4096}
CALL = {"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ASK = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w20 weather"}]
HISTORY = [*ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_7", "content": "w30 sunny"}]
SCENARIOS = {
    "plain chat": {"messages": ASK},
    "thinking off": {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
    "thinking on": {"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}},
    "tools": {"messages": ASK, "tools": [TOOL]},
    "tool calls and results": {"messages": HISTORY, "tools": [TOOL]},
    "earlier reasoning": {"messages": [
        *ASK, {"role": "assistant", "content": "w40", "reasoning_content": "w41 w42"},
        {"role": "user", "content": "w43"}]},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("model", ["qwen3", "deepseek_v3"])
def test_published_templates_render_and_tokenize_as_transformers(tmp_path: Path, model: str,
                                                                 scenario: str) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    template_tokenizer(tmp_path, model)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                        chat_template=published_template(model),
                                        **TEMPLATE_SPECIAL[model])
    body = SCENARIOS[scenario]
    options = {"conversation": body["messages"], "tools": body.get("tools"),
               "add_generation_prompt": True, **body.get("chat_template_kwargs", {})}
    template = load_chat_template([tmp_path])
    chat = ChatOptions(tool_call_parser="hermes")  # so that the tools are accepted
    assert template.render(body["messages"], body.get("tools"),
                           body.get("chat_template_kwargs")) == \
        reference.apply_chat_template(**options, tokenize=False)
    expected = reference.apply_chat_template(**options)
    if hasattr(expected, "keys"):  # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    parsed = parse_chat_request({**body, "max_tokens": 2}, PUBLISHED_CONFIG, tokenizer,
                                template, chat=chat)
    assert parsed.prompts == [list(expected)]


def test_an_answer_that_only_called_tools_renders_for_both_templates(tmp_path: Path) -> None:
    # content null: DeepSeek-V3's template writes the calls only then; Qwen3's fails on the
    # null and gets "" (what vLLM and SGLang always give), the same as the message with "".
    echoed = [*HISTORY[:2], {"role": "assistant", "content": None, "tool_calls": [CALL]},
              HISTORY[3]]
    qwen3 = ChatTemplate(published_template("qwen3"))
    assert qwen3.render(echoed, [TOOL]) == qwen3.render(HISTORY, [TOOL])
    deepseek = ChatTemplate(published_template("deepseek_v3"),
                            TEMPLATE_SPECIAL["deepseek_v3"])
    assert deepseek.render(echoed) == (
        "<｜begin▁of▁sentence｜>w10 w11<｜User｜>w20 weather<｜Assistant｜><｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n"
        "```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>w30 sunny"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


def test_the_request_decides_how_the_answer_is_read(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from numaov.runtime.service.chat_output import TOOL_CALL_SYNTAX

    template_tokenizer(tmp_path, "qwen3")
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    template = load_chat_template([tmp_path])
    chat = ChatOptions(template_kwargs={"enable_thinking": False}, reasoning_parser="qwen3",
                       tool_call_parser="hermes")

    def parse(**body):
        return parse_chat_request({"messages": ASK, "max_tokens": 2, **body}, PUBLISHED_CONFIG,
                                  tokenizer, template, chat=chat)

    quiet = parse(tools=[TOOL])  # the server's default: thinking off
    assert quiet.chat_output.reasoning == "qwen3" and not quiet.chat_output.starts_in_reasoning
    assert quiet.chat_output.tool_calls is TOOL_CALL_SYNTAX["hermes"]
    thinking = parse(tools=[TOOL], chat_template_kwargs={"enable_thinking": True})
    assert thinking.chat_output.starts_in_reasoning
    assert len(thinking.prompts[0]) < len(quiet.prompts[0])  # no empty <think> block
    shown = parse(tools=[TOOL], tool_choice="none")  # the tools are rendered, calls not read
    assert shown.chat_output.tool_calls is None and shown.prompts == quiet.prompts
    assert parse().chat_output.tool_calls is None
    # "required" and a named function: the output is forced to be the calls' JSON
    named = parse(tools=[TOOL], tool_choice={"type": "function",
                                             "function": {"name": "get_weather"}})
    assert named.chat_output.forced.name == "get_weather"
    assert named.chat_output.tool_calls is None
    assert named.params[0][0].structured.schema == TOOL["function"]["parameters"]
    required = parse(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    assert required.chat_output.forced.name is None
    schema = required.params[0][0].structured.schema
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    with pytest.raises(RequestError, match="names the function 'nope', which is not among the "
                       "tools; expected one of 'get_weather'") as e:
        parse(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(RequestError, match="tool_choice and response_format each ask") as e:
        parse(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"})
    assert e.value.param == "response_format"
    with pytest.raises(RequestError, match="parallel_tool_calls false is not supported"):
        parse(tools=[TOOL], parallel_tool_calls=False)
    assert parse(parallel_tool_calls=False).chat_output.tool_calls is None


def test_server_options_are_checked() -> None:
    with pytest.raises(RequestError, match="sets 'messages'") as e:
        ChatOptions(template_kwargs={"messages": []})
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(RequestError, match="expected one of deepseek_v3, hermes"):
        ChatOptions(tool_call_parser="mistral")


def test_bad_serve_chat_flags_fail_before_any_model_loads(tmp_path: Path, capsys) -> None:
    from numaov.cli import main

    absent = ["serve", "--model-dir", str(tmp_path / "absent")]
    assert main([*absent, "--chat-template-kwargs", '{"tools": 1}']) == 1
    for flags in (["--chat-template-kwargs", "[1]"], ["--reasoning-parser", "granite"]):
        with pytest.raises(SystemExit) as e:  # argparse's checks exit while parsing
            main([*absent, *flags])
        assert e.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines
    assert "--chat-template-kwargs: chat_template_kwargs sets 'tools'" in lines[0]
    assert "'[1]' is not a JSON object" in lines[1]
    assert "invalid choice: 'granite'" in lines[2]

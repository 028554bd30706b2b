"""Chat prompts: the model directory's template rendered as transformers'
``apply_chat_template`` renders it (same text, same token ids), and the plain template."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.deepseek_harness import tiny_tokenizer
from support.service_harness import CHAT_TEMPLATE as TEMPLATE
from support.service_harness import chat_tokenizer

from numaov.runtime.service.chat_template import ChatTemplateError, load_chat_template
from numaov.runtime.service.lm_requests import parse_chat_request

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
        parse_chat_request({"messages": [{"role": "tool", "content": "x"}]}, CONFIG, tokenizer,
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
     "tools", "not supported"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json"}},
     "response_format", "does not constrain"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}, "temperature",
     "expected a number"),
])
def test_bad_chat_bodies_name_the_field(tmp_path: Path, body: dict, param: str,
                                        message: str) -> None:
    from tokenizers import Tokenizer

    from numaov.runtime.service.errors import RequestError

    tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    with pytest.raises(RequestError, match=message) as e:
        parse_chat_request(body, CONFIG, tokenizer, load_chat_template([tmp_path]))
    assert e.value.param == param and e.value.status == 400

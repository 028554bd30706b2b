"""OpenAI completion and chat bodies, checked into engine requests.

:func:`parse_completion_request` reads a ``/v1/completions`` body and
:func:`parse_chat_request` a ``/v1/chat/completions`` one; both return an
:class:`LMRequest`: the prompts as token ids, one :class:`SamplingParams` per choice
(``n`` choices per prompt; with a ``seed``, choice ``j`` of a prompt samples with
``seed + j``, so the choices differ and each is reproducible), and how to answer (stream,
usage in the stream). Every refusal is one :class:`RequestError` naming the field.

The model's positions bound the prompt and ``max_tokens`` here (the default ``max_tokens``
is cut to what fits, from :func:`~numaov.runtime.lm.sequence.positions_left`), so the
engine's own check at submit never refuses a parsed request for them; the token ids and stop
ids against the vocabulary are the engine's check at submit alone (the routes name the field).

Fields numaov does not implement are accepted only at the value that changes nothing, or
only when absent or empty; anything else (a typo such as "max_token" included) is refused,
so no request is silently answered differently from what it asked. Parsing tokenizes text,
so the service runs it off the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from numaov.runtime.lm.sequence import GenerationInputError, SamplingParams, positions_left
from numaov.runtime.service.chat_template import ChatTemplate
from numaov.runtime.service.errors import RequestError

DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI's
MAX_CHOICES = 16  # n at most

_NEUTRAL = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0}
# OpenAI's API takes temperatures from 0 to 2; the engine itself takes any (`run lm`).
MAX_TEMPERATURE = 2.0
_SHARED = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "user",
           "logprobs", "presence_penalty", "frequency_penalty", "logit_bias")
_COMPLETION_ONLY = ("prompt", "echo", "suffix", "best_of")
_CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
              "tool_choice", "parallel_tool_calls", "functions", "function_call", "store",
              "metadata")
_EMPTY_ONLY = ("echo", "suffix", "logit_bias", "tools", "tool_choice", "functions",
               "function_call", "parallel_tool_calls", "store", "metadata")
COMPLETION_FIELDS = (*_SHARED, *_COMPLETION_ONLY)
CHAT_FIELDS = (*_SHARED, *_CHAT_ONLY)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class LMRequest:
    """A checked completion or chat body: ``prompts`` (token ids), ``params[i][j]`` the
    settings of choice ``j`` of prompt ``i``."""

    prompts: list[list[int]]
    params: list[list[SamplingParams]]
    stream: bool = False
    include_usage: bool = False
    # chat: the chosen tokens' log-probabilities in chat's shape
    logprobs: bool = False
    # the field the prompts came from ("prompt", or "messages" for chat): errors name it
    prompt_param: str = "prompt"

    @property
    def n(self) -> int:
        return len(self.params[0])

    @property
    def max_tokens(self) -> int:
        return self.params[0][0].max_new_tokens


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: ``max_tokens`` the most new tokens (None: the model's
    positions), ``max_prompt_tokens`` the longest prompt (None: the model's positions)."""

    max_tokens: int | None = None
    max_prompt_tokens: int | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param)


def _check_fields(body: Any, known: tuple[str, ...], shape: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _refuse(f"the request body is not a JSON object; expected {shape}")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise _refuse(f"unknown field(s) {', '.join(unknown)}; expected only OpenAI fields "
                      f"({', '.join(known)})", unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value):
            raise _refuse(f"{name} is {json.dumps(value)}; expected a number", name)
        if value != neutral:
            raise _refuse(f"{name} {json.dumps(value)} is not supported: this server samples "
                          f"without penalties or best-of; expected {name} absent or {neutral}",
                          name)
    for name in _EMPTY_ONLY:
        if body.get(name) not in (None, False, "", [], {}):
            raise _refuse(f"{name} is not supported by this server; expected it absent, false "
                          "or empty", name)
    return body


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise _refuse(f"{name} is {json.dumps(value)}; expected a positive integer", name)
    return value


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value not in (None, False, True):
        raise _refuse(f"{name} is {json.dumps(value)}; expected true or false", name)
    return bool(value)


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options in (None, {}):
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _refuse(f"stream_options is {json.dumps(options)}; expected "
                      '{"include_usage": true|false}', "stream_options")
    if not stream:
        raise _refuse("stream_options is set but stream is not; expected stream: true",
                      "stream_options")
    return _bool(options, "include_usage")


def _sampling(body: Mapping[str, Any], max_tokens: int, logprobs: bool, n: int,
              tokenizer: Any) -> list[SamplingParams]:
    """One SamplingParams per choice, each setting checked by SamplingParams."""
    stop = body.get("stop")
    if stop is None:
        stop = []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise _refuse(f"stop is {json.dumps(stop)}; expected a string or a list of strings",
                      "stop")
    if stop and tokenizer is None:
        raise _refuse("stop strings need the text, but this server was started without a "
                      "tokenizer; expected stop_token_ids", "stop")
    settings: dict[str, Any] = {
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "top_k": body.get("top_k"), "seed": body.get("seed"),
        "stop_token_ids": body.get("stop_token_ids"), "ignore_eos": body.get("ignore_eos"),
    }
    settings = {k: v for k, v in settings.items() if v is not None}
    if "ignore_eos" in settings and not isinstance(settings["ignore_eos"], bool):
        raise _refuse(f"ignore_eos is {json.dumps(settings['ignore_eos'])}; expected true or "
                      "false", "ignore_eos")
    if "stop_token_ids" in settings and not isinstance(settings["stop_token_ids"], list):
        raise _refuse(f"stop_token_ids is {json.dumps(settings['stop_token_ids'])}; expected a "
                      "list of token ids", "stop_token_ids")
    temperature = settings.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
            and temperature > MAX_TEMPERATURE:
        raise _refuse(f"temperature is {json.dumps(temperature)}; expected a number from 0 to "
                      f"{MAX_TEMPERATURE:g} (OpenAI's range)", "temperature")
    seed = settings.pop("seed", None)
    out = []
    for j in range(n):
        if seed is not None and _is_int(seed) and j > 0:
            seed_j = (seed + j) % 2**63
        else:
            seed_j = seed
        try:
            out.append(SamplingParams(max_tokens, stop=tuple(stop), logprobs=logprobs,
                                      seed=seed_j, **settings))
        except GenerationInputError as exc:
            raise _refuse(str(exc), exc.parameter) from None
    return out


def _choices(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise _refuse(f"n is {json.dumps(n)}; expected an integer from 1 to {MAX_CHOICES}", "n")
    return n


def _max_tokens(requested: int | None, default: int, longest: int, config: Mapping[str, Any],
                limits: Limits, param: str) -> int:
    positions = int(config["max_position_embeddings"])
    room = positions_left(config, longest)
    cap = room if limits.max_tokens is None else min(room, limits.max_tokens)
    if requested is None:
        if cap < 1:
            raise _refuse(f"the {longest}-token prompt leaves no room in the model's "
                          f"{positions} positions; expected a shorter prompt", "prompt")
        return min(default, cap)
    if requested > cap:
        why = (f"with a {longest}-token prompt exceeds the model's {positions} positions"
               if limits.max_tokens is None or room < limits.max_tokens
               else f"exceeds this server's limit of {limits.max_tokens}")
        raise _refuse(f"{param} {requested} {why}; expected {param} at most {max(cap, 0)}",
                      param if longest < positions else "prompt")
    return requested


def _check_prompt_lengths(prompts: list[list[int]], config: Mapping[str, Any], limits: Limits,
                          param: str) -> None:
    longest = max(len(p) for p in prompts)
    limit = int(config["max_position_embeddings"]) - 1  # room for one new token
    if limits.max_prompt_tokens is not None:
        limit = min(limit, limits.max_prompt_tokens)
    if longest > limit:
        raise _refuse(f"the prompt has {longest} tokens; expected at most {limit}", param)


def _finish(prompts: list[list[int]], body: Mapping[str, Any], config: Mapping[str, Any],
            tokenizer: Any, limits: Limits, requested: int | None, requested_name: str,
            default: int, logprobs: bool, prompt_param: str, chat: bool) -> LMRequest:
    _check_prompt_lengths(prompts, config, limits, prompt_param)
    n = _choices(body)
    stream = _bool(body, "stream")
    include_usage = _stream_options(body, stream)
    longest = max(len(p) for p in prompts)
    max_tokens = _max_tokens(requested, default, longest, config, limits, requested_name)
    params = _sampling(body, max_tokens, logprobs, n, tokenizer)
    return LMRequest(prompts, [params] * len(prompts), stream, include_usage,
                     logprobs and chat, prompt_param)


def parse_completion_request(body: Any, config: Mapping[str, Any], tokenizer: Any = None,
                             limits: Limits | None = None) -> LMRequest:
    """Check a ``/v1/completions`` JSON body against the model; token ids per prompt."""
    body = _check_fields(body, COMPLETION_FIELDS, '{"prompt": ..., "max_tokens": N}')
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, True, 0, 1):
        raise _refuse(f"logprobs is {json.dumps(logprobs)}; expected 0 or 1 (this server "
                      "returns the chosen token's log-probability only)", "logprobs")
    prompts = _prompt_ids(body.get("prompt"), tokenizer)
    return _finish(prompts, body, config, tokenizer, limits or Limits(),
                   _positive_int(body, "max_tokens"), "max_tokens", DEFAULT_MAX_TOKENS,
                   bool(logprobs), "prompt", chat=False)


def parse_chat_request(body: Any, config: Mapping[str, Any], tokenizer: Any,
                       template: ChatTemplate, limits: Limits | None = None) -> LMRequest:
    """Check a ``/v1/chat/completions`` JSON body; the messages rendered with ``template``
    and tokenized."""
    body = _check_fields(body, CHAT_FIELDS, '{"messages": [{"role": "user", "content": ...}]}')
    if tokenizer is None:
        raise _refuse("chat needs the text, but this server was started without a tokenizer; "
                      "expected /v1/completions with token ids, or a server with a tokenizer",
                      "messages")
    logprobs = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise _refuse(f"top_logprobs is {json.dumps(top)}; expected 0 or absent (this server "
                      "returns the chosen token's log-probability only)", "top_logprobs")
    fmt = body.get("response_format")
    if fmt not in (None, {}, {"type": "text"}):
        raise _refuse(f"response_format is {json.dumps(fmt)}; expected {{\"type\": \"text\"}} "
                      "(this server does not constrain the output)", "response_format")
    for name in ("max_tokens", "max_completion_tokens"):
        _positive_int(body, name)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None \
            and body["max_tokens"] != body["max_completion_tokens"]:
        raise _refuse("max_tokens and max_completion_tokens differ; expected one of them",
                      "max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    messages = _messages(body.get("messages"))
    ids = template.encode(tokenizer, messages)
    if not ids:
        raise _refuse("the messages render to no tokens; expected some content", "messages")
    positions = int(config["max_position_embeddings"])
    return _finish([ids], body, config, tokenizer, limits or Limits(), body.get(name), name,
                   positions, logprobs, "messages", chat=True)


def _messages(messages: Any) -> list[dict[str, str]]:
    expected = 'expected a list of {"role": ..., "content": "text"} objects'
    if not isinstance(messages, list) or not messages:
        raise _refuse(f"messages is {json.dumps(messages)[:80]}; {expected}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _refuse(f"messages[{i}] is not an object; {expected}", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise _refuse(f"messages[{i}].role is {json.dumps(role)}; expected one of "
                          f"{', '.join(CHAT_ROLES)}", "messages")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise _refuse(f"messages[{i}].content holds a part that is not text; "
                                  'expected {"type": "text", "text": ...} parts', "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _refuse(f"messages[{i}].content is {json.dumps(content)[:80]}; expected text",
                          "messages")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise _refuse(f"messages[{i}] has field(s) {', '.join(sorted(extra))} this server "
                          "does not support; expected role, content and name", "messages")
        out.append({"role": role, "content": content,
                    **({"name": message["name"]} if "name" in message else {})})
    return out


def _is_token_id(value: Any) -> bool:
    return _is_int(value)


def _prompt_ids(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """The four OpenAI prompt forms: text, texts, token ids, lists of token ids."""
    expected = ("expected a string, a list of strings, a list of token ids or a list of lists "
                "of token ids")
    if prompt is None:
        raise _refuse(f"prompt is missing; {expected}", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list):
        raise _refuse(f"prompt is {json.dumps(prompt)}; {expected}", "prompt")
    if not prompt:
        raise _refuse(f"prompt is an empty list; {expected}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        if tokenizer is None:
            raise _refuse("prompt is text but this server was started without a tokenizer; "
                          "expected token ids", "prompt")
        out = []
        for i, text in enumerate(prompt):
            ids = tokenizer.encode(text).ids
            if not ids:
                raise _refuse(f"prompt {i} ({text[:40]!r}) encodes to no tokens; expected "
                              "non-empty text", "prompt")
            out.append(list(ids))
        return out
    if all(isinstance(p, list) for p in prompt):
        for i, ids in enumerate(prompt):
            if not all(_is_token_id(t) for t in ids):
                raise _refuse(f"prompt {i} holds values that are not token ids; expected "
                              "integers", "prompt")
        return [list(p) for p in prompt]
    if any(isinstance(p, (str, list)) for p in prompt):
        raise _refuse(f"prompt mixes texts, token ids and lists; {expected}", "prompt")
    if not all(_is_token_id(t) for t in prompt):
        raise _refuse("prompt holds values that are not token ids; expected integers", "prompt")
    return [list(prompt)]

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

Chat also reads what chat clients and agents send (see :func:`parse_chat_request`):
``tools`` and ``tool_choice`` (the tools go to the chat template; the answer's calls are
parsed with the server's ``--tool-call-parser``), assistant messages with ``tool_calls``,
``tool`` messages, and ``chat_template_kwargs`` (extra variables for the chat template, over
the server's ``--chat-template-kwargs``). How the answer's text is split (reasoning, content,
tool calls) is decided here, per request, as a
:class:`~numaov.runtime.service.chat_output.ChatOutputFormat`. Both read structured outputs
(``response_format``, vLLM's ``structured_outputs``) into the choices' ``SamplingParams``
(a :class:`~numaov.runtime.lm.grammar.GrammarSpec`), and chat the calls a ``tool_choice``
of "required" or a named function forces (:func:`forced_call_spec`).

Fields numaov does not implement are accepted only at the value that changes nothing, or
only when absent or empty; anything else (a typo such as "max_token" included) is refused,
so no request is silently answered differently from what it asked. Parsing tokenizes text,
so the service runs it off the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from numaov.runtime.lm.grammar import GrammarSpec
from numaov.runtime.lm.sequence import GenerationInputError, SamplingParams, positions_left
from numaov.runtime.service.chat_output import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    TOOL_CALL_SYNTAX,
    ChatOutputFormat,
    ForcedCalls,
    reasoning_starts_open,
)
from numaov.runtime.service.chat_template import ChatTemplate
from numaov.runtime.service.errors import RequestError

DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI's
# A prompt longer than the limit is refused from its first limit * this many characters
# (encode_bounded): text averages about 4 characters a token; 32 leaves room for long ones.
PREFIX_CHARS_PER_TOKEN = 32
MAX_CHOICES = 16  # n at most

_NEUTRAL = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0}
# OpenAI's API takes temperatures from 0 to 2; the engine itself takes any (`run lm`).
MAX_TEMPERATURE = 2.0
_SHARED = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "user",
           "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
           "response_format", "structured_outputs")
_COMPLETION_ONLY = ("prompt", "echo", "suffix", "best_of")
_CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "tools",
              "tool_choice", "parallel_tool_calls", "functions", "function_call", "store",
              "metadata", "chat_template_kwargs")
_EMPTY_ONLY = ("echo", "suffix", "logit_bias", "functions", "function_call", "store",
               "metadata")
COMPLETION_FIELDS = (*_SHARED, *_COMPLETION_ONLY)
CHAT_FIELDS = (*_SHARED, *_CHAT_ONLY)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# What the chat template is given besides chat_template_kwargs: a key among these is refused.
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
# Assistant message fields an OpenAI client echoes back from an answer, accepted empty.
_ECHOED_EMPTY = ("refusal", "audio", "function_call", "annotations")


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
    # chat: how the answers' text is split into reasoning, content and tool calls
    chat_output: ChatOutputFormat = field(default_factory=ChatOutputFormat)

    @property
    def n(self) -> int:
        return len(self.params[0])

    @property
    def max_tokens(self) -> int:
        return self.params[0][0].max_new_tokens


@dataclass(frozen=True)
class ChatOptions:
    """How a server renders chat requests and reads their answers: ``template_kwargs`` the
    chat template's extra variables every request starts from (``--chat-template-kwargs``; a
    request's ``chat_template_kwargs`` override them key by key), ``reasoning_parser`` and
    ``tool_call_parser`` (vLLM's names; None: off)."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        check_template_kwargs(self.template_kwargs, "chat_template_kwargs")
        for name, value, known in (("reasoning_parser", self.reasoning_parser,
                                    REASONING_PARSERS),
                                   ("tool_call_parser", self.tool_call_parser,
                                    TOOL_CALL_PARSERS)):
            if value is not None and value not in known:
                raise RequestError(f"{name} {value!r} is not known; expected one of "
                                   f"{', '.join(known)}", name)


def check_template_kwargs(value: Any, param: str) -> dict[str, Any]:
    """``chat_template_kwargs`` (a request's, or the server's default): an object whose keys
    are not among what the template is given anyway (:data:`TEMPLATE_VARIABLES`)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _refuse(f"{param} is {json.dumps(value)[:80]}; expected an object of extra chat "
                      'template variables, such as {"enable_thinking": false}', param)
    taken = [key for key in value if key in TEMPLATE_VARIABLES]
    if taken:
        raise _refuse(f"{param} sets {taken[0]!r}, which the server gives the chat template "
                      f"itself; expected other names than {', '.join(TEMPLATE_VARIABLES)}",
                      param)
    return dict(value)


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


def _refuse(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(message, param, code=code)


# OpenAI's error.code for a prompt (and max_tokens) that does not fit the context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


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


def _bool(body: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    """``body[name]`` as true or false (absent: false); ``param``: the field errors name
    (default ``name``; a nested field's top-level one)."""
    value = body.get(name)
    if value not in (None, False, True):  # (0 and 1 are taken as false and true)
        raise _refuse(f"{name} is {json.dumps(value)}; expected true or false", param or name)
    return bool(value)


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options in (None, {}):
        return False
    # include_obfuscation (recent OpenAI clients): there are no obfuscation fields to leave out
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise _refuse(f"stream_options is {json.dumps(options)}; expected "
                      '{"include_usage": true|false}', "stream_options")
    if not stream:
        raise _refuse("stream_options is set but stream is not; expected stream: true",
                      "stream_options")
    _bool(options, "include_obfuscation", "stream_options")
    return _bool(options, "include_usage", "stream_options")


def _sampling(body: Mapping[str, Any], max_tokens: int, logprobs: bool, n: int,
              tokenizer: Any, structured: GrammarSpec | None) -> list[SamplingParams]:
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
                                      seed=seed_j, structured=structured, **settings))
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
                          f"{positions} positions; expected a shorter prompt", "prompt",
                          CONTEXT_LENGTH_EXCEEDED)
        return min(default, cap)
    if requested > cap:
        why = (f"with a {longest}-token prompt exceeds the model's {positions} positions"
               if limits.max_tokens is None or room < limits.max_tokens
               else f"exceeds this server's limit of {limits.max_tokens}")
        raise _refuse(f"{param} {requested} {why}; expected {param} at most {max(cap, 0)}",
                      param if longest < positions else "prompt",
                      CONTEXT_LENGTH_EXCEEDED if room < requested else None)
    return requested


def prompt_limit(config: Mapping[str, Any], limits: Limits) -> int:
    """The longest prompt in tokens: the model's positions less one new token, or
    ``--max-prompt-tokens`` if lower."""
    limit = int(config["max_position_embeddings"]) - 1  # room for one new token
    if limits.max_prompt_tokens is not None:
        limit = min(limit, limits.max_prompt_tokens)
    return limit


def encode_bounded(encode: Callable[[str], list[int]], text: str, limit: int,
                   param: str) -> list[int]:
    """``encode(text)``, except that a text longer than ``limit`` tokens could take is
    refused from bounded prefixes: its first ``limit * PREFIX_CHARS_PER_TOKEN`` characters,
    then twice as many, and so on, each refusing it once it holds more than ``limit`` tokens;
    so a text of long tokens costs a few times the first prefix, not the whole text. Tokenizing
    holds the GIL (a 4 MB prompt: 3 s of the event loop's time); this costs milliseconds."""
    cut = limit * PREFIX_CHARS_PER_TOKEN
    while len(text) > cut:
        head = encode(text[:cut])
        if len(head) > limit:
            raise _refuse(f"the prompt has more than {limit} tokens ({len(head)} in its first "
                          f"{cut} of {len(text)} characters); expected at most {limit}", param,
                          CONTEXT_LENGTH_EXCEEDED)
        cut *= 2
    return encode(text)


def _check_prompt_lengths(prompts: list[list[int]], config: Mapping[str, Any], limits: Limits,
                          param: str) -> None:
    longest = max(len(p) for p in prompts)
    limit = prompt_limit(config, limits)
    if longest > limit:
        raise _refuse(f"the prompt has {longest} tokens; expected at most {limit}", param,
                      CONTEXT_LENGTH_EXCEEDED)


def _structure(body: Mapping[str, Any], forced: GrammarSpec | None) -> GrammarSpec | None:
    """The structure the output must have: ``response_format`` (OpenAI's), vLLM's
    ``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``),
    or the calls ``tool_choice`` forces; at most one of them. JSON is compact (``,`` and
    ``:`` with no free whitespace), as vLLM's default is: a model allowed whitespace anywhere
    can spend every token it has on it."""
    fmt, vllm = body.get("response_format"), body.get("structured_outputs")
    given = [name for name, value in (("response_format", fmt), ("structured_outputs", vllm))
             if value not in (None, {}, {"type": "text"})]
    if forced is not None:
        given.insert(0, "tool_choice")
    if len(given) > 1:
        raise _refuse(f"{' and '.join(given)} each ask for a structure; expected one of them",
                      given[1])
    try:
        if fmt not in (None, {}):
            spec = GrammarSpec.from_response_format(fmt, any_whitespace=False)
            if spec is not None:
                return spec
        if vllm not in (None, {}):
            return _structured_outputs(vllm)
    except GenerationInputError as exc:
        raise _refuse(str(exc), exc.parameter) from None
    return forced


def _structured_outputs(value: Any) -> GrammarSpec:
    """vLLM's ``structured_outputs`` object: exactly one of its keys."""
    param = "structured_outputs"
    kinds = ("json", "json_object", "regex", "choice", "grammar")
    given = [k for k in kinds if isinstance(value, Mapping) and value.get(k) not in (None, False)]
    unknown = sorted(set(value) - set(kinds)) if isinstance(value, Mapping) else []
    if not isinstance(value, Mapping) or len(given) != 1 or unknown:
        raise _refuse(f"structured_outputs is {json.dumps(value)[:80]}; expected an object "
                      f"with exactly one of {', '.join(kinds)}", param)
    kind = given[0]
    body = value[kind]
    if kind == "json":
        return GrammarSpec.json_schema(body, any_whitespace=False, parameter=param)
    if kind == "json_object":
        return GrammarSpec.json_object(any_whitespace=False, parameter=param)
    if kind == "regex":
        return GrammarSpec.regex(body, parameter=param)
    if kind == "choice":
        return GrammarSpec.choice(body, parameter=param)
    return GrammarSpec.grammar(body, parameter=param)


def _finish(prompts: list[list[int]], body: Mapping[str, Any], config: Mapping[str, Any],
            tokenizer: Any, limits: Limits, requested: int | None, requested_name: str,
            default: int, logprobs: bool, prompt_param: str, chat: bool,
            forced: GrammarSpec | None = None) -> LMRequest:
    _check_prompt_lengths(prompts, config, limits, prompt_param)
    n = _choices(body)
    stream = _bool(body, "stream")
    include_usage = _stream_options(body, stream)
    longest = max(len(p) for p in prompts)
    max_tokens = _max_tokens(requested, default, longest, config, limits, requested_name)
    params = _sampling(body, max_tokens, logprobs, n, tokenizer, _structure(body, forced))
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
    limits = limits or Limits()
    prompts = _prompt_ids(body.get("prompt"), tokenizer, prompt_limit(config, limits))
    return _finish(prompts, body, config, tokenizer, limits,
                   _positive_int(body, "max_tokens"), "max_tokens", DEFAULT_MAX_TOKENS,
                   logprobs is not None and logprobs is not False, "prompt", chat=False)


def parse_chat_request(body: Any, config: Mapping[str, Any], tokenizer: Any,
                       template: ChatTemplate, limits: Limits | None = None,
                       chat: ChatOptions | None = None) -> LMRequest:
    """Check a ``/v1/chat/completions`` JSON body; the messages (with the request's tools and
    template variables over ``chat``'s) rendered with ``template`` and tokenized."""
    body = _check_fields(body, CHAT_FIELDS, '{"messages": [{"role": "user", "content": ...}]}')
    chat = chat or ChatOptions()
    if tokenizer is None:
        raise _refuse("chat needs the text, but this server was started without a tokenizer; "
                      "expected /v1/completions with token ids, or a server with a tokenizer",
                      "messages")
    logprobs = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise _refuse(f"top_logprobs is {json.dumps(top)}; expected 0 or absent (this server "
                      "returns the chosen token's log-probability only)", "top_logprobs")
    for name in ("max_tokens", "max_completion_tokens"):
        _positive_int(body, name)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None \
            and body["max_tokens"] != body["max_completion_tokens"]:
        raise _refuse("max_tokens and max_completion_tokens differ; expected one of them",
                      "max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    tools = _tools(body.get("tools"))
    calls_parsed, forced = _tool_choice(body, tools, chat)
    template_kwargs = {**chat.template_kwargs,
                       **check_template_kwargs(body.get("chat_template_kwargs"),
                                               "chat_template_kwargs")}
    messages = _messages(body.get("messages"))
    text = template.render(messages, tools, template_kwargs)
    ids = encode_bounded(lambda t: template.tokenize(tokenizer, t), text,
                         prompt_limit(config, limits or Limits()), "messages")
    if not ids:
        raise _refuse("the messages render to no tokens; expected some content", "messages")
    output = ChatOutputFormat(
        reasoning=chat.reasoning_parser,
        starts_in_reasoning=(chat.reasoning_parser is not None and reasoning_starts_open(
            chat.reasoning_parser, text, template_kwargs)),
        tool_calls=TOOL_CALL_SYNTAX[chat.tool_call_parser] if calls_parsed else None,
        forced=forced)
    positions = int(config["max_position_embeddings"])
    parsed = _finish([ids], body, config, tokenizer, limits or Limits(), body.get(name), name,
                     positions, logprobs, "messages", chat=True,
                     forced=None if forced is None else forced_call_spec(
                         tools or [], forced.name, body.get("parallel_tool_calls") is not False))
    return replace(parsed, chat_output=output)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools, as the chat template gets them (None: no tools)."""
    if tools in (None, []):
        return None
    expected = ('expected a list of {"type": "function", "function": {"name": ..., '
                '"parameters": {...}}} objects')
    if not isinstance(tools, list):
        raise _refuse(f"tools is {json.dumps(tools)[:80]}; {expected}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(function, dict) and isinstance(function.get("name"), str)
                and function["name"]):
            raise _refuse(f"tools[{i}] is {json.dumps(tool)[:80]}; {expected}", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _refuse(f"tools[{i}].function.parameters is {json.dumps(parameters)[:80]}; "
                          "expected a JSON Schema object", "tools")
    return tools


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None,
                 chat: ChatOptions) -> tuple[bool, ForcedCalls | None]:
    """(whether the answer's tool calls are parsed, the calls ``tool_choice`` forces). "auto"
    (the default with tools) parses the answer with the server's tool-call parser; "none"
    renders the tools but parses nothing, as vLLM does; "required" and a named function force
    the output to be the calls' JSON through a grammar (:func:`forced_call_spec`), so they
    need no parser and always parse."""
    choice = body.get("tool_choice")
    named = (isinstance(choice, dict) and choice.get("type") == "function"
             and isinstance(choice.get("function"), dict)
             and isinstance(choice["function"].get("name"), str))
    if choice is not None and choice not in ("auto", "none", "required") and not named:
        raise _refuse(f"tool_choice is {json.dumps(choice)[:80]}; expected \"auto\", "
                      '"none", "required" or {"type": "function", "function": {"name": ...}}',
                      "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise _refuse(f"parallel_tool_calls is {json.dumps(parallel)[:80]}; expected true or "
                      "false", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise _refuse(f"tool_choice is {json.dumps(choice)} but there are no tools; "
                          "expected tools, or tool_choice absent", "tool_choice")
        return False, None
    if choice == "none":
        return False, None
    if choice == "required" or named:
        name = choice["function"]["name"] if named else None
        names = [tool["function"]["name"] for tool in tools]
        if name is not None and name not in names:
            raise _refuse(f"tool_choice names the function {name!r}, which is not among the "
                          f"tools; expected one of {', '.join(map(repr, names))}",
                          "tool_choice")
        return False, ForcedCalls(name)
    if chat.tool_call_parser is None:
        raise _refuse("tools need a tool-call parser to read the answer's calls, and this "
                      'server has none; expected tool_choice "none", "required" or a named '
                      "function, or a server started with --tool-call-parser "
                      f"{'|'.join(TOOL_CALL_PARSERS)}", "tools")
    if parallel is False:
        raise _refuse("parallel_tool_calls false is not supported with tool_choice auto: the "
                      "output is not constrained, so the model may call several tools; "
                      'expected true or absent, or tool_choice "required"',
                      "parallel_tool_calls")
    return True, None


def forced_call_spec(tools: list[dict[str, Any]], name: str | None,
                     parallel: bool) -> GrammarSpec:
    """The grammar of the calls ``tool_choice`` forces, as vLLM builds it: for a named
    function, its arguments (its ``parameters`` schema); for "required", a JSON array of one
    (``parallel`` false) or more ``{"name": ..., "parameters": {...}}`` objects, each one of
    the tools."""
    def parameters(tool: Mapping[str, Any]) -> Any:
        return tool["function"].get("parameters") or {"type": "object"}

    try:
        if name is not None:
            tool = next(t for t in tools if t["function"]["name"] == name)
            return GrammarSpec.json_schema(parameters(tool),
                                           strict=bool(tool["function"].get("strict")),
                                           any_whitespace=False, parameter="tool_choice")
        item = {"anyOf": [
            {"type": "object", "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": parameters(tool)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for tool in tools]}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
        if not parallel:
            schema["maxItems"] = 1
        return GrammarSpec.json_schema(schema, any_whitespace=False, parameter="tool_choice")
    except GenerationInputError as exc:
        raise _refuse(str(exc), "tools") from None


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _refuse(f"{where} holds a part that is not text; expected "
                              '{"type": "text", "text": ...} parts', "messages")
            texts.append(part["text"])
        return "".join(texts)
    if not isinstance(content, str):
        raise _refuse(f"{where} is {json.dumps(content)[:80]}; expected text", "messages")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked and passed on as sent (``arguments``
    as JSON text, OpenAI's form, or an object, transformers' form)."""
    expected = ('expected a list of {"id": ..., "type": "function", "function": {"name": ..., '
                '"arguments": "<JSON>"}} objects')
    if not isinstance(calls, list):
        raise _refuse(f"{where} is {json.dumps(calls)[:80]}; {expected}", "messages")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("type", "function") == "function"
                and isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), (str, dict))):
            raise _refuse(f"{where}[{j}] is {json.dumps(call)[:80]}; {expected}", "messages")
    return calls


_MESSAGE_FIELDS = {"system": ("content", "name"), "developer": ("content", "name"),
                   "user": ("content", "name"), "tool": ("content", "name", "tool_call_id"),
                   "assistant": ("content", "name", "tool_calls", "reasoning_content",
                                 "reasoning", *_ECHOED_EMPTY)}


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the chat template gets them: text content (null allowed for an
    assistant message that calls tools), and the tool-calling fields checked."""
    expected = 'expected a list of {"role": ..., "content": "text"} objects'
    if not isinstance(messages, list) or not messages:
        raise _refuse(f"messages is {json.dumps(messages)[:80]}; {expected}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _refuse(f"messages[{i}] is not an object; {expected}", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _refuse(f"messages[{i}].role is {json.dumps(role)}; expected one of "
                          f"{', '.join(CHAT_ROLES)}", "messages")
        allowed = _MESSAGE_FIELDS[role]
        extra = set(message) - {"role", *allowed}
        if extra:
            raise _refuse(f"messages[{i}] ({role}) has field(s) {', '.join(sorted(extra))} this "
                          f"server does not support; expected role, {', '.join(allowed)}",
                          "messages")
        for name in _ECHOED_EMPTY:
            if message.get(name) not in (None, [], {}, ""):
                raise _refuse(f"messages[{i}].{name} is not supported by this server; expected "
                              "it absent, null or empty", "messages")
        out_message: dict[str, Any] = {"role": role}
        calls = message.get("tool_calls")
        if role == "assistant" and message.get("content") is None:
            out_message["content"] = None  # an answer that only called tools (see render)
        else:
            out_message["content"] = _text(message.get("content"), f"messages[{i}].content")
        if message.get("name") is not None:
            out_message["name"] = message["name"]
        if role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not isinstance(tool_call_id, str):
                raise _refuse(f"messages[{i}].tool_call_id is {json.dumps(tool_call_id)}; "
                              "expected the id of the call this message answers", "messages")
            out_message["tool_call_id"] = tool_call_id
        if role == "assistant":
            if calls not in (None, []):
                out_message["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
            elif out_message["content"] is None:
                raise _refuse(f"messages[{i}].content is null and the message calls no tools; "
                              "expected text", "messages")
            # The reasoning of an earlier answer, under vLLM's old name or its new one;
            # templates read reasoning_content (Qwen3's drops it outside the last turn).
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise _refuse(f"messages[{i}].reasoning_content is "
                                  f"{json.dumps(reasoning)[:80]}; expected text", "messages")
                out_message["reasoning_content"] = reasoning
        out.append(out_message)
    return out


def _is_token_id(value: Any) -> bool:
    return _is_int(value)


def _prompt_ids(prompt: Any, tokenizer: Any, limit: int) -> list[list[int]]:
    """The four OpenAI prompt forms: text, texts, token ids, lists of token ids; a text
    longer than ``limit`` tokens is refused from a prefix (:func:`encode_bounded`)."""
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
            ids = encode_bounded(lambda t: tokenizer.encode(t).ids, text, limit, "prompt")
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

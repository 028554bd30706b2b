"""A chat answer's text split into what clients read: reasoning, content and tool calls.

``numaov serve --reasoning-parser`` and ``--tool-call-parser`` take vLLM's parser names and
split the generated text as vLLM's parsers of those names do:

- reasoning (``qwen3``, ``deepseek_r1``): the text before ``</think>`` is the reasoning
  (``message.reasoning_content``), the rest the content; a ``<think>`` that opens the output
  is dropped. The output may also start inside the reasoning with no tag at all (DeepSeek-R1's
  template and Qwen3's thinking templates write ``<think>`` into the prompt), so without
  ``</think>`` everything is reasoning (a cut-off answer). The answer starts in the content
  instead when the prompt already closed the reasoning (it ends with ``</think>``: Qwen3's
  template with ``enable_thinking: false`` writes an empty block) and, for ``qwen3``, when
  the template variable ``enable_thinking`` is false, as vLLM's Qwen3 parser reads it.
- tool calls (``hermes``: Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  ``deepseek_v3``: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``
  inside ``<｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>``): each call becomes an OpenAI
  ``tool_call`` (``id`` "call_...", ``type`` "function", ``function.name``,
  ``function.arguments`` as JSON text), the text outside the calls is the content. A call
  that does not parse stays in the content as it was written, as vLLM leaves it; a call cut
  off by the end of the output is read as if closed (vLLM's hermes parser does the same).

One parser serves both ways of answering: a whole answer is the stream's deltas added up,
fed the same pieces, so the two always agree. The parsers read text, not token ids, so a tag
split over several tokens (or several deltas) is found all the same: while the text so far
ends in what may be the start of a tag, that end is held back until the next piece decides.
Unlike vLLM's streaming parsers, a tool call is sent in one delta (id, name and the whole
arguments) once it is complete and known to parse, because a call that turns out malformed
must stay content and what was streamed cannot be taken back.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from numaov import NumaovError

REASONING_PARSERS = ("deepseek_r1", "qwen3")
TOOL_CALL_PARSERS = ("deepseek_v3", "hermes")

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def _partial_tag_length(text: str, tags: Sequence[str]) -> int:
    """How long the end of ``text`` is that begins one of ``tags`` (held back while
    streaming: the next piece may complete the tag)."""
    longest = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:length]):
                longest = length
                break
    return longest


def reasoning_starts_open(parser: str, prompt: str, template_kwargs: Mapping[str, Any]) -> bool:
    """Whether the answer to ``prompt`` begins inside the reasoning (see the module doc)."""
    if prompt.rstrip().endswith(THINK_CLOSE):
        return False
    return not (parser == "qwen3" and template_kwargs.get("enable_thinking") is False)


class ReasoningSplitter:
    """Generated text, fed in pieces, into (reasoning, content)."""

    def __init__(self, starts_open: bool) -> None:
        # "start": inside the reasoning, before any text but whitespace (a <think> may come);
        # "reasoning": until </think>; "content": the rest.
        self._state = "start" if starts_open else "content"
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state != "content"

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                text = stripped[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(stripped):  # whitespace, or the tag's beginning so far
                self._held = text
                return "", ""
            self._state = "reasoning"
        if self._state == "reasoning":
            reasoning, found, content = text.partition(THINK_CLOSE)
            if found:
                self._state = "content"
                return reasoning, content
            keep = _partial_tag_length(text, (THINK_CLOSE,))
            self._held = text[len(text) - keep:] if keep else ""
            return text[:len(text) - keep], ""
        return "", text

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended (a tag that never completed is
        text)."""
        held, self._held = self._held, ""
        return ("", held) if self._state == "content" else (held, "")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_call`` (with ``index``: a streamed ``tool_calls`` delta entry)."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _hermes_call(body: str) -> tuple[str, str] | None:
    """``{"name": ..., "arguments": {...}}`` -> (name, arguments as JSON text)."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


_DEEPSEEK_V3_CALL = re.compile(r"(?P<type>[^\n]*)<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n"
                               r"(?P<arguments>.*)\n```\s*", re.DOTALL)


def _deepseek_v3_call(body: str) -> tuple[str, str] | None:
    """``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```` -> (name, ARGS, kept as written
    once it parses as a JSON object, as vLLM's parser passes it on)."""
    match = _DEEPSEEK_V3_CALL.fullmatch(body)
    if match is None or match["type"] != "function" or not match["name"].strip():
        return None
    try:
        arguments = json.loads(match["arguments"])
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return match["name"].strip(), match["arguments"].strip()


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a model writes its calls: each between ``open`` and ``close``; ``markers`` (the
    tags around a group of calls) are markup, never content; ``parse`` reads what is between
    ``open`` and ``close`` into (name, arguments), or None when it is not a call."""

    open: str
    close: str
    markers: tuple[str, ...]
    parse: Callable[[str], tuple[str, str] | None]


TOOL_CALL_SYNTAX = {
    "hermes": ToolCallSyntax("<tool_call>", "</tool_call>", (), _hermes_call),
    "deepseek_v3": ToolCallSyntax("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                                  ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
                                  _deepseek_v3_call),
}
# Every tag a parser needs to see in the decoded text (`numaov serve` checks the tokenizer
# writes them back, rather than dropping them as special tokens).
PARSER_TAGS = {"qwen3": (THINK_OPEN, THINK_CLOSE), "deepseek_r1": (THINK_OPEN, THINK_CLOSE),
               "hermes": ("<tool_call>", "</tool_call>"),
               "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                               "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")}


def check_parser_tags(tokenizer: Any, parser: str, param: str) -> None:
    """Refuse ``parser`` (the value of the server option ``param``) for a tokenizer that
    does not write the parser's tags back as text: a tag the tokenizer treats as a special
    token is skipped when decoding, and the parser would never see it."""
    if tokenizer is None:
        raise NumaovError(f"{parser} reads the answers' text, but this server has no "
                          "tokenizer; expected a tokenizer directory (--tokenizer)",
                          parameter=param)
    for tag in PARSER_TAGS[parser]:
        written = tokenizer.decode(list(tokenizer.encode(tag, add_special_tokens=False).ids))
        if written != tag:
            raise NumaovError(f"{parser} needs the tag {tag!r} in the decoded text, but this "
                              f"tokenizer writes it back as {written!r}; expected the "
                              f"tokenizer of a model that writes {tag!r} (as a token that is "
                              "not skipped as special)", parameter=param)


class ToolCallSplitter:
    """Content text, fed in pieces, into content and :class:`ToolCall` s, in order."""

    def __init__(self, syntax: ToolCallSyntax) -> None:
        self._syntax = syntax
        self._tags = (syntax.open, *syntax.markers)
        self._held = ""  # content that may begin a tag
        self._call: str | None = None  # the text of the call being written, after its tag

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        text, self._held = self._held + text, ""
        while text:
            if self._call is None:
                hits = [(i, tag) for tag in self._tags if (i := text.find(tag)) >= 0]
                if not hits:
                    keep = _partial_tag_length(text, self._tags)
                    self._held = text[len(text) - keep:] if keep else ""
                    out.append(text[:len(text) - keep])
                    break
                start, tag = min(hits)
                out.append(text[:start])
                text = text[start + len(tag):]
                if tag == self._syntax.open:
                    self._call = ""
                continue
            searched = max(0, len(self._call) - len(self._syntax.close))
            self._call += text
            end = self._call.find(self._syntax.close, searched)
            if end < 0:
                break
            body, text = self._call[:end], self._call[end + len(self._syntax.close):]
            self._call = None
            out.append(self._read(body, closed=True))
        return [piece for piece in out if piece != ""]

    def finish(self) -> list[str | ToolCall]:
        """What was held back, once the output has ended: a call cut off is read as if
        closed; a tag that never completed is content."""
        out: list[str | ToolCall] = [self._held] if self._held else []
        self._held = ""
        if self._call is not None:
            out.append(self._read(self._call, closed=False))
            self._call = None
        return out

    def _read(self, body: str, closed: bool) -> str | ToolCall:
        call = self._syntax.parse(body.strip())
        if call is not None:
            return ToolCall(*call)
        return self._syntax.open + body + (self._syntax.close if closed else "")


@dataclass(frozen=True)
class ForcedCalls:
    """``tool_choice`` "required" (``name`` None) or a named function: the output is JSON
    the grammar forced (``lm_requests.forced_call_spec``): the named function's arguments,
    or an array of ``{"name", "parameters"}`` calls, as vLLM forces them."""

    name: str | None = None


class ForcedCallSplitter:
    """The forced calls' JSON, read once the output has ended (the grammar made it parse
    unless ``max_tokens`` cut it: a named call then keeps the arguments written so far, as
    vLLM returns them; a cut-off array stays content)."""

    def __init__(self, forced: ForcedCalls) -> None:
        self._name = forced.name
        self._text = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        self._text += text
        return []

    def finish(self) -> list[str | ToolCall]:
        text, self._text = self._text.strip(), ""
        if self._name is not None:
            return [ToolCall(self._name, text)]
        try:
            calls = json.loads(text)
            return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                    for c in calls]
        except (ValueError, TypeError, KeyError):
            return [text] if text else []


@dataclass(frozen=True)
class ChatOutputFormat:
    """How one chat request's answers are split: ``reasoning`` the reasoning parser (None:
    off) and whether the answer starts inside the reasoning, ``tool_calls`` the tool-call
    syntax (None: the request asked for no tool calls, or the server parses none),
    ``forced`` the calls ``tool_choice`` forced (then the output is their JSON)."""

    reasoning: str | None = None
    starts_in_reasoning: bool = False
    tool_calls: ToolCallSyntax | None = None
    forced: ForcedCalls | None = None

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tool_calls is None and self.forced is None


class ChatAnswer:
    """One choice's answer as it is generated: each piece of text in, the OpenAI delta out;
    what the deltas add up to is the whole answer's message. ``reasoning_tokens`` counts the
    tokens generated while the reasoning was open (OpenAI's
    ``completion_tokens_details.reasoning_tokens``)."""

    def __init__(self, output: ChatOutputFormat) -> None:
        self.output = output
        self._reasoning = (ReasoningSplitter(output.starts_in_reasoning)
                           if output.reasoning is not None else None)
        self._calls: ToolCallSplitter | ForcedCallSplitter | None = (
            ForcedCallSplitter(output.forced) if output.forced is not None
            else ToolCallSplitter(output.tool_calls) if output.tool_calls else None)
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.reasoning_tokens = 0
        # With tool calls parsed, content whitespace is held back until more content
        # follows, so that the whitespace around calls ("\n" between two of them) does not
        # become content of its own.
        self._space = ""

    def add(self, tokens: int, text: str, last: bool = False) -> dict[str, Any]:
        """The delta for ``text`` (generated by ``tokens`` new tokens); ``last``: the output
        ended with it, so everything held back comes out."""
        if self._reasoning is not None and self._reasoning.in_reasoning:
            self.reasoning_tokens += tokens
        reasoning, content = (self._reasoning.feed(text) if self._reasoning is not None
                              else ("", text))
        pieces = self._calls.feed(content) if self._calls is not None else [content]
        if last:
            if self._reasoning is not None:
                more_reasoning, more_content = self._reasoning.finish()
                reasoning += more_reasoning
                if self._calls is not None:
                    pieces += self._calls.feed(more_content)
                else:
                    pieces.append(more_content)
            if self._calls is not None:
                pieces += self._calls.finish()
        return self._delta(reasoning, pieces, last)

    def _delta(self, reasoning: str, pieces: list[str | ToolCall], last: bool) -> dict[str, Any]:
        content, calls = "", []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                calls.append(piece.as_dict(len(self.tool_calls)))
                self.tool_calls.append(piece)
            elif self._calls is None:
                content += piece
            else:
                text = self._space + piece
                kept = text.rstrip()
                if kept:
                    content += kept
                    self._space = text[len(kept):]
                else:
                    self._space = text
        if last and self._space and not self.tool_calls:
            content += self._space
        if last:
            self._space = ""
        self.reasoning += reasoning
        self.content += content
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self) -> dict[str, Any]:
        """The whole answer as OpenAI's assistant message."""
        if self.output.plain:
            return {"role": "assistant", "content": self.content}
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.output.reasoning is not None:
            message["reasoning_content"] = self.reasoning or None
        if self.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        return message

    def finish_reason(self, engine_reason: str) -> str:
        """As OpenAI answers: ``"tool_calls"`` when the model called a tool, but ``"stop"``
        for the function a named ``tool_choice`` forced, and ``"length"`` whenever
        ``max_tokens`` cut a forced call (its arguments do not parse then); else why the
        engine stopped."""
        if not self.tool_calls:
            return engine_reason
        forced = self.output.forced
        if forced is None:
            return "tool_calls"
        if engine_reason != "stop":
            return engine_reason
        return "stop" if forced.name is not None else "tool_calls"

"""Structured outputs: the grammar a request's new tokens must follow, as a mask of tokens.

A request asks for a structure with a :class:`GrammarSpec` in its
:class:`~numaov.runtime.lm.sequence.SamplingParams` (``structured``): any JSON object, JSON
that validates against a JSON Schema, a regular expression, one of a list of strings, or a
context-free grammar (vLLM's ``structured_outputs`` forms). The engine does what vLLM V1
does: it keeps one :class:`GrammarMatcher` per constrained sequence in its own process;
whenever the scheduler plans a row that samples (a decode row, or a prompt's last chunk), the
matcher's state gives that row a bitmask of the tokens allowed next (int32 words, bit ``i`` of
word ``j`` = token ``32 * j + i``, ``ceil(vocab_size / 32)`` words); the rank sets the other
tokens' logits to -inf before it samples (:func:`numaov.runtime.lm.sampler.sample_token`: the
logits never leave the rank), and when the engine gets the sampled token back it advances the
matcher. When the structure is complete and nothing can follow it, the sequence ends with
finish reason "stop"; where more could follow (a regex ``a+``), the mask allows the
end-of-sequence token(s) beside the continuations. ``max_new_tokens`` reached first ends it
with "length" and the text is the structure's beginning, as OpenAI returns it.

The library is llguidance (``benchmarks/structured_output.py`` measured it against xgrammar:
``benchmarks/RESULTS.md``): its JSON Schema compiler, Lark and GBNF grammars and Rust regexes,
on the engine's ``tokenizers.Tokenizer``. :class:`GrammarCompiler` builds the vocabulary once
(byte-level BPE, byte-fallback / SentencePiece-style ``▁`` vocabularies and any other
tokenizer with a decoder llguidance reads from ``tokenizer.json``; a tokenizer with no decoder,
a plain word-level vocabulary, is taken as raw tokens: each token's own characters, nothing
between them), with the model's ``vocab_size`` as the mask's size (ids the tokenizer does not
have are never allowed), and keeps the last ``COMPILED_GRAMMARS`` compiled specs (least
recently used out); each sequence's matcher is a copy of its spec's compiled one.

A spec the library cannot compile is a :class:`GenerationInputError` whose ``parameter`` is
the spec's (``response_format`` unless the caller says otherwise), with the library's reason
on one line.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np

from numaov.runtime.lm.sequence import GenerationInputError

__all__ = ["COMPILED_GRAMMARS", "GRAMMAR_KINDS", "GrammarCompiler", "GrammarMatcher",
           "GrammarSpec", "mask_words"]

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Compiled specs kept per engine. A JSON Schema compiles in about a millisecond (llguidance
# builds its lexer lazily), so the cache saves little time; what it keeps is each spec's
# lexer states built so far, which the copies of its matcher share.
COMPILED_GRAMMARS = 64
# llguidance's defaults, except error messages: the reason only, not the parser's state.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Keys of a JSON Schema whose value is a schema, a list of schemas, or a map of names to
# schemas: where strict mode looks for objects to close.
_SCHEMA_KEYS = ("items", "additionalProperties", "additionalItems", "contains", "not", "if",
                "then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions",
                    "dependentSchemas")


def mask_words(vocab_size: int) -> int:
    """int32 words of a token mask over ``vocab_size`` ids."""
    return (vocab_size + 31) // 32


# -- what a request asks for --------------------------------------------------------------------


@dataclass(frozen=True)
class GrammarSpec:
    """The structure a request's new tokens must follow; build it with the class methods.

    ``kind`` is one of ``GRAMMAR_KINDS``; ``value`` the JSON Schema as JSON text
    (``json_schema``; :attr:`schema` parses it), the regex, the tuple of choices or the
    grammar's text. ``strict`` (JSON Schema): objects without ``additionalProperties`` get
    ``false`` (exactly their properties, as OpenAI's strict mode) and a keyword the library
    does not implement is an error; not strict, the schema means what JSON Schema says (open
    objects) and such a keyword is ignored with a warning in the log. ``any_whitespace`` (JSON
    kinds): any whitespace between tokens, as a model formats JSON; False: compact JSON (``,``
    and ``:``, no spaces). ``parameter`` names the request field in errors. Equal specs share
    one compiled grammar.
    """

    kind: str
    value: str | tuple[str, ...] | None = None
    strict: bool = False
    any_whitespace: bool = True
    parameter: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        def refuse(message: str) -> GenerationInputError:
            return GenerationInputError(message, parameter=self.parameter)

        if self.kind not in GRAMMAR_KINDS:
            raise refuse(f"structured output kind {self.kind!r} is not known; expected one of "
                         f"{', '.join(GRAMMAR_KINDS)}")
        for name in ("strict", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise refuse(f"{name} is {getattr(self, name)!r}; expected true or false")
        value = self.value
        if self.kind == "json_object":
            if value is not None:
                raise refuse(f"json_object takes no value; got {value!r}")
        elif self.kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise refuse(f"the JSON schema is not valid JSON ({exc})") from None
            if not isinstance(value, Mapping):
                raise refuse(f"the JSON schema is {_short(value)}; expected a JSON Schema "
                             "object such as {\"type\": \"object\", \"properties\": {...}}")
            try:
                object.__setattr__(self, "value", json.dumps(value, separators=(",", ":")))
            except (TypeError, ValueError) as exc:
                raise refuse(f"the JSON schema cannot be written as JSON ({exc})") from None
        elif self.kind == "choice":
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise refuse(f"choice is {_short(value)}; expected a list of strings")
            options = tuple(value)
            if not options or not all(isinstance(o, str) and o for o in options):
                raise refuse(f"choice is {_short(list(options))}; expected a non-empty list of "
                             "non-empty strings")
            object.__setattr__(self, "value", options)
        elif not isinstance(value, str) or not value.strip():
            what = "regex" if self.kind == "regex" else "grammar"
            raise refuse(f"the {what} is {_short(value)}; expected a non-empty string")

    # -- the forms ------------------------------------------------------------------------------

    @classmethod
    def json_object(cls, *, any_whitespace: bool = True,
                    parameter: str = "response_format") -> GrammarSpec:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object", None, any_whitespace=any_whitespace, parameter=parameter)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, *, strict: bool = False,
                    any_whitespace: bool = True,
                    parameter: str = "response_format") -> GrammarSpec:
        """JSON valid under ``schema`` (a dict, or its JSON text)."""
        return cls("json_schema", schema, strict, any_whitespace,  # type: ignore[arg-type]
                   parameter)

    @classmethod
    def regex(cls, pattern: str, *, parameter: str = "response_format") -> GrammarSpec:
        """Text that ``pattern`` matches whole (Rust ``regex`` syntax)."""
        return cls("regex", pattern, parameter=parameter)

    @classmethod
    def choice(cls, options: Iterable[str], *,
               parameter: str = "response_format") -> GrammarSpec:
        """Exactly one of ``options``."""
        return cls("choice", options, parameter=parameter)  # type: ignore[arg-type]

    @classmethod
    def grammar(cls, text: str, *, parameter: str = "response_format") -> GrammarSpec:
        """Text of a context-free grammar: Lark (llguidance's dialect, ``start:``) or GBNF
        (llama.cpp's, ``root ::=``)."""
        return cls("grammar", text, parameter=parameter)

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any], *,
                             any_whitespace: bool = True,
                             parameter: str = "response_format") -> GrammarSpec | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (None: no structure),
        ``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name":
        ..., "schema": {...}, "strict": bool}}``."""
        def refuse(message: str) -> GenerationInputError:
            return GenerationInputError(message, parameter=parameter)

        if not isinstance(response_format, Mapping):
            raise refuse(f"response_format is {_short(response_format)}; expected an object "
                         "with a type")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(any_whitespace=any_whitespace, parameter=parameter)
        if kind == "json_schema":
            body = response_format.get("json_schema")
            if not isinstance(body, Mapping) or "schema" not in body:
                raise refuse("response_format of type json_schema needs json_schema.schema; "
                              "expected {\"type\": \"json_schema\", \"json_schema\": {\"name\": "
                              "..., \"schema\": {...}}}")
            strict = body.get("strict")
            return cls.json_schema(body["schema"], strict=bool(strict) if strict is not None
                                   else False, any_whitespace=any_whitespace,
                                   parameter=parameter)
        raise refuse(f"response_format type {kind!r} is not known; expected text, json_object "
                     "or json_schema")

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema (``json_schema``), else None."""
        return json.loads(self.value) if self.kind == "json_schema" else None  # type: ignore

    def describe(self) -> str:
        """A few words for messages: kind and the start of the value."""
        if self.value is None:
            return self.kind
        return f"{self.kind} {_short(self.value)}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not
    set it (strict mode)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _SCHEMA_LIST_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SCHEMA_MAP_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    kinds = out.get("type")
    is_object = kinds == "object" or (isinstance(kinds, list) and "object" in kinds) or (
        kinds is None and "properties" in out)
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _one_line(message: str) -> str:
    """The library's reason on one line: no source excerpts, carets or parser positions."""
    lines = []
    for line in message.splitlines():
        line = line.strip()
        if not line or set(line) <= {"^", " "} or re.match(r"^\d+ \|", line):
            continue
        lines.append(re.sub(r"^at \d+\(\d+\): ", "", line))
    return " ".join(lines) or "no reason given"


# -- compiling and matching ---------------------------------------------------------------------


class GrammarMatcher:
    """One sequence's place in its grammar: the mask of tokens allowed next, and accepting the
    sampled token. Used only under the engine's lock."""

    def __init__(self, matcher: Any, spec: GrammarSpec, vocab_size: int,
                 library_words: int) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self._matcher = matcher
        self._library_words = library_words
        # why the matcher cannot go on (the library's error state), else None
        self.error: str | None = None

    def next_mask(self) -> np.ndarray | None:
        """``[mask_words(vocab_size)] int32``: the tokens allowed next; None (and
        :attr:`error` set) when the matcher failed or allows nothing."""
        size = mask_words(self.vocab_size)
        # the library's mask covers its vocabulary: the tokenizer's ids, or the model's
        words = np.zeros(max(self._library_words, size), dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, 4 * self._library_words)
        if self._matcher.is_error():
            self.error = _one_line(self._matcher.get_error())
            return None
        mask = words[:size]
        if self.vocab_size % 32:  # ids past the model's vocabulary in the last word
            mask[-1] &= np.int32((1 << (self.vocab_size % 32)) - 1)
        if not mask.any():
            self.error = "the grammar allows no token here"
            return None
        return mask

    def accept(self, token: int) -> bool:
        """Advance by the sampled ``token``; False (and :attr:`error` set) if the grammar
        does not allow it."""
        if self._matcher.consume_token(int(token)):
            return True
        self.error = _one_line(self._matcher.get_error()) or f"token {token} was refused"
        return False

    @property
    def done(self) -> bool:
        """The structure is complete and nothing but the end of the sequence can follow."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """The vocabulary of ``tokenizer`` for masks of ``vocab_size`` ids (built once), compiled
    specs (the last ``cache_size``), and a matcher per sequence; thread-safe.

    ``end_ids``: the model's end-of-sequence ids, allowed once the structure is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: Iterable[int], *,
                 cache_size: int = COMPILED_GRAMMARS) -> None:
        self.vocab_size = int(vocab_size)
        self.cache_size = cache_size
        self._tokenizer = _vocabulary(tokenizer, self.vocab_size, sorted(end_ids))
        self._library_words = mask_words(self._tokenizer.vocab_size)
        self._compiled: collections.OrderedDict[GrammarSpec, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def compiled(self) -> int:
        """Specs compiled and kept now."""
        with self._lock:
            return len(self._compiled)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for ``spec`` (compiled now, or taken from the cache)."""
        if not isinstance(spec, GrammarSpec):
            raise GenerationInputError(f"structured is {_short(spec)}; expected a GrammarSpec",
                                       parameter="response_format")
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
        if compiled is None:
            compiled = self._compile(spec)  # outside the lock: other specs need not wait
            with self._lock:
                self._compiled[spec] = compiled
                self._compiled.move_to_end(spec)
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        with self._lock:
            copy = compiled.deep_copy()
        return GrammarMatcher(copy, spec, self.vocab_size, self._library_words)

    def _compile(self, spec: GrammarSpec) -> Any:
        def refuse(reason: str) -> GenerationInputError:
            return GenerationInputError(f"cannot use {spec.describe()} as structured output: "
                                        f"{reason}", parameter=spec.parameter)

        try:
            grammar = _library_grammar(spec)
        except ValueError as exc:
            raise refuse(_one_line(str(exc))) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise refuse(_one_line(matcher.get_error()))
        for warning in matcher.get_grammar_warnings():
            logger.warning("structured output %s: %s (not enforced)", spec.describe(),
                           _one_line(warning))
        probe = GrammarMatcher(matcher.deep_copy(), spec, self.vocab_size, self._library_words)
        if probe.next_mask() is None:
            raise refuse(probe.error or "it allows no token")
        return matcher


def _library_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar text for ``spec``."""
    if spec.kind in ("json_object", "json_schema"):
        schema: Any = {"type": "object"} if spec.kind == "json_object" else spec.schema
        if spec.strict:
            schema = _closed(schema)
        options = {"whitespace_flexible": spec.any_whitespace, "lenient": not spec.strict}
        if not spec.any_whitespace:
            options.update(item_separator=",", key_separator=":")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             overrides=options)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", list(spec.value))  # type: ignore[arg-type]
    return llguidance.grammar_from("regex" if spec.kind == "regex" else "grammar",
                                   spec.value)  # type: ignore[arg-type]


def _vocabulary(tokenizer: Any, vocab_size: int, end_ids: list[int]) -> Any:
    """llguidance's tokenizer for ``tokenizer`` (a ``tokenizers.Tokenizer``), masks of at
    least ``vocab_size`` ids."""
    size = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
    eos = end_ids or None
    text = tokenizer.to_str()
    if json.loads(text).get("decoder") is not None:
        try:
            return llguidance.LLTokenizer(text, n_vocab=size, eos_token=eos)
        except (ValueError, RuntimeError) as exc:
            raise GenerationInputError(
                f"structured output cannot read this tokenizer's vocabulary: "
                f"{_one_line(str(exc))}", parameter="tokenizer") from None
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_RawVocabulary(tokenizer,
                                                                             end_ids)),
                                  n_vocab=size, eos_token=eos)


class _RawVocabulary:
    """A tokenizer with no decoder (a word-level vocabulary) as llguidance's wrapper takes
    it: each token's own characters, the special tokens named."""

    def __init__(self, tokenizer: Any, end_ids: list[int]) -> None:
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._tokenizer = tokenizer
        self.tokens = [(tokenizer.id_to_token(i) or "").encode() for i in range(size)]
        self.special_token_ids = sorted(
            i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special)
        self.eos_token_id = end_ids[0] if end_ids else None
        self.bos_token_id = None

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

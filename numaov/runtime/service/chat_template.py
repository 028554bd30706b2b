"""Chat messages to prompt text: the model's own chat template, rendered as transformers does.

A Hugging Face model directory keeps its chat template in ``tokenizer_config.json``
(``chat_template``: one Jinja template, or a list of named ones of which "default" is used)
together with the special tokens it refers to (``bos_token``, ``eos_token``, ...).
:class:`ChatTemplate` renders it the way transformers' ``apply_chat_template`` does: a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter, the ``raise_exception`` and ``strftime_now`` globals, the
special tokens as variables and ``add_generation_prompt=True``, the request's ``tools`` and
its ``chat_template_kwargs`` as further variables (overriding the special tokens, as
transformers' keyword arguments do); the text is then tokenized without adding special
tokens (the template writes them itself), as transformers does.

Messages reach the template as the client sent them (tool calls with their ``arguments`` as
JSON text, which Qwen3's and DeepSeek-V3's templates both write as is), with one exception:
an assistant message whose ``content`` is null (a client echoing a tool-calling answer) has
no one rendering that suits every template. It is given to the template as null first, as
transformers 4 gives it: DeepSeek-V3's template writes an assistant message's tool calls only
when its content is null. A template that fails on the null (Qwen3's tests
``'</think>' in content``) gets ``""`` there instead, which is what vLLM and SGLang always
give. (transformers 5 drops null keys, and both templates then fail on the missing content.)

Without a template, the documented plain one (:data:`PLAIN_TEMPLATE`): every message as
``"<role>: <content>\\n"``, then ``"assistant:"``; that text is tokenized like a completion
prompt (the tokenizer's post-processor adds what it adds).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from numaov.runtime.service.errors import RequestError

logger = logging.getLogger(__name__)

PLAIN_TEMPLATE = (  # content null (an assistant message that only calls tools) as ""
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] or '' }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                   "mask_token")


class ChatTemplateError(RequestError):
    """The messages cannot be rendered with the model's template."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """The chat template of a model directory (``source`` None: the plain template)."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str] | None = None,
                 origin: str = "") -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source if source is not None else PLAIN_TEMPLATE)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template in {origin} is not valid Jinja "
                                    f"({exc}); expected a transformers chat template") from None

    @property
    def plain(self) -> bool:
        return self.source is None

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (``tools``: the request's tool list;
        ``template_kwargs``: extra variables for the template)."""
        variables = {**self.special_tokens, **(template_kwargs or {})}
        try:
            return self._render(messages, tools, variables)
        except ChatTemplateError:
            nulls = [i for i, m in enumerate(messages)
                     if m.get("role") == "assistant" and m.get("content") is None]
            if not nulls:
                raise
            texts = [{**m, "content": ""} if i in nulls else m for i, m in enumerate(messages)]
            try:
                return self._render(texts, tools, variables)
            except ChatTemplateError as exc:
                raise ChatTemplateError(f"{exc} (also with messages[{nulls[0]}].content as "
                                        '"" rather than null)', "messages") from None

    def _render(self, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None, variables: Mapping[str, Any]) -> str:
        import jinja2

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         tools=list(tools) if tools is not None else None,
                                         documents=None, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}",
                                    "messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template that does string or list operations on a value of another type
            # (None content, a dict where it expects text) fails in Python, not in Jinja.
            raise ChatTemplateError(f"the model's chat template failed on the messages "
                                    f"({type(exc).__name__}: {exc}); expected messages of the "
                                    "shape the template reads", "messages") from None

    def encode(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None,
               template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The prompt's token ids (:meth:`render`, then :meth:`tokenize`)."""
        return self.tokenize(tokenizer, self.render(messages, tools, template_kwargs))

    def tokenize(self, tokenizer: Any, text: str) -> list[int]:
        """A rendered prompt's token ids (the plain template's text is tokenized like a
        completion prompt; a model's own template writes its special tokens itself)."""
        return list(tokenizer.encode(text, add_special_tokens=self.plain).ids)


def load_chat_template(directories: Iterable[str | Path | None]) -> ChatTemplate:
    """The template in the first of ``directories`` whose ``tokenizer_config.json`` has one;
    the plain template when none has."""
    for directory in directories:
        if directory is None:
            continue
        path = Path(directory) / "tokenizer_config.json"
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {str(path)!r} as JSON ({exc}); expected a "
                                    "Hugging Face tokenizer_config.json", "tokenizer") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            continue
        tokens = {name: text for name in _SPECIAL_TOKENS
                  if (text := _token_text(config.get(name))) is not None}
        logger.info("chat template from %s", path)
        return ChatTemplate(source, tokens, str(path))
    return ChatTemplate(None, origin="the plain template")

"""A `numaov serve` process started by the tests, and what it printed."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.deepseek_harness import CLI, greedy_reference, tiny_tokenizer

STARTUP_S = 300
STOP_S = 60
# A template in the style of real ones: special tokens, a system prompt, loop controls,
# raise_exception, the generation prompt, and whitespace that trim_blocks/lstrip_blocks shape.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
world {{ message['content'] }}
    {% elif message['role'] == 'user' %}
hello {{ message['content'] | trim }}
    {% elif message['role'] == 'assistant' %}
cat {{ message['content'] }} {{ eos_token }}
    {% else %}
{{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if loop.index > 8 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
sat
{% endif %}"""


def chat_tokenizer(directory: Path):
    """The tiny word-level tokenizer with a tokenizer_config.json carrying CHAT_TEMPLATE and
    its special tokens (bos as an AddedToken dict, as transformers saves it)."""
    tokenizer = tiny_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "the", "special": True}, "eos_token": "mat",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tokenizer


# Published chat templates, stored as test fixtures (tests/service/templates/; each file's
# first comment names its source): nothing is downloaded while the tests run.
TEMPLATES = Path(__file__).resolve().parent.parent / "service" / "templates"
# The tokens each template writes, added to the tiny tokenizer so that the prompt's ids
# depend on the template's special tokens as they do in the real tokenizers.
TEMPLATE_TOKENS = {
    "qwen3": ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>"),
    "deepseek_v3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜tool▁outputs▁begin｜>",
                    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁outputs▁end｜>"),
}
TEMPLATE_SPECIAL = {"qwen3": {"eos_token": "<|im_end|>"},
                    "deepseek_v3": {"bos_token": "<｜begin▁of▁sentence｜>",
                                    "eos_token": "<｜end▁of▁sentence｜>"}}


def published_template(name: str) -> str:
    """The chat template of ``name`` ("qwen3", "deepseek_v3") as its model publishes it."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def template_tokenizer(directory: Path, name: str):
    """The tiny word-level tokenizer with ``name``'s template tokens added, and a
    tokenizer_config.json carrying the published template and special tokens."""
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer(directory)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in TEMPLATE_TOKENS[name]])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        **TEMPLATE_SPECIAL[name], "chat_template": published_template(name),
        "tokenizer_class": "PreTrainedTokenizerFast"}, ensure_ascii=False))
    return tokenizer


# The template of the scripted tokenizer: every message, tool call and tool on a line of its
# own, and a line when enable_thinking is false; no tags, so the prompt's ids do not depend on
# the tags the script gives to generated ids.
SCRIPT_TEMPLATE = """{% for message in messages %}
{{ message['role'] }} {{ message['content'] or '' }}
{% for call in message['tool_calls'] or [] %}
called {{ call['function']['name'] }} {{ call['function']['arguments'] }}
{% endfor %}
{% endfor %}
{% for tool in tools or [] %}
tool {{ tool['function']['name'] }}
{% endfor %}
{% if enable_thinking is defined and enable_thinking is false %}
quiet
{% endif %}
{% if add_generation_prompt %}assistant{% endif %}"""


@dataclass
class Script:
    """What the tiny model is to write, word by word (``pieces``), for a one-user-message
    chat with ``tools`` and ``template_kwargs``; ``messages`` is filled in by
    :func:`scripted_tokenizer`."""

    pieces: Sequence[str]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)


def scripted_tokenizer(directory: Path, model: Any, scripts: Sequence[Script], eos: int = 1):
    """A tokenizer under which the tiny model's greedy answer to each script's chat decodes
    to the script's pieces joined by spaces, with SCRIPT_TEMPLATE in its
    tokenizer_config.json.

    For each script, user messages ``"wA wB"`` are tried until the model's greedy tokens are
    distinct, none is the end token, and none is in any script's prompt or taken by another
    script; the tiny word-level vocabulary's words at those ids are then renamed to the
    pieces (the pieces that are tags, such as ``<tool_call>``, also become added tokens, so
    that they encode and decode as one token, as in the models' own tokenizers). The prompts
    never contain the new words, so their ids are the same under the new vocabulary."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from numaov.runtime.service.chat_template import ChatTemplate

    base = tiny_tokenizer(directory)
    template = ChatTemplate(SCRIPT_TEMPLATE)
    renamed: dict[int, str] = {}
    prompt_ids: set[int] = set()
    candidates = iter((a, b) for a in range(20, 500, 13) for b in range(30, 500, 17))
    for script in scripts:
        for a, b in candidates:
            messages = [{"role": "user", "content": f"w{a} w{b}"}]
            ids = template.tokenize(base, template.render(messages, script.tools,
                                                          script.template_kwargs))
            out = greedy_reference(model, [ids], len(script.pieces))[0][0]
            blocked = prompt_ids | set(ids) | set(renamed) | {0, eos}
            if len(set(out)) == len(out) and not set(out) & blocked \
                    and not set(renamed) & set(ids):
                script.messages = messages
                prompt_ids |= set(ids)
                renamed.update(zip(out, script.pieces, strict=True))
                break
        else:
            raise AssertionError(f"no user message makes the tiny model write {script.pieces}")
    vocab = {word: i for word, i in base.get_vocab().items() if i not in renamed}
    vocab.update({piece: i for i, piece in renamed.items()})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_tokens([AddedToken(piece, special=False, normalized=False)
                          for piece in renamed.values()
                          if piece.startswith("<") and piece.endswith(">")])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": SCRIPT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tokenizer


def stop_server(server: Server) -> str:
    """SIGTERM: a clean stop (workers closed, exit 0, no traceback); the whole output."""
    server.proc.send_signal(signal.SIGTERM)
    output = server.rest_of_output(STOP_S)
    assert server.proc.returncode == 0, output
    assert "numaov serve: stopped" in output and "Traceback" not in output, output
    return output


def shared_memory_of(pid: int) -> list[str]:
    """/dev/shm entries of the rank groups a server process started (their job ids begin
    with its pid)."""
    return [name for name in os.listdir("/dev/shm") if f"-{pid}-" in name]


class Server:
    """A `numaov serve` process and the lines it printed."""

    def __init__(self, args: list[str], bind: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "NUMAOV_CPU_BIND": bind, **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.output.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r}; output: {''.join(self.output)}")

    def rest_of_output(self, timeout_s: float) -> str:
        self.proc.wait(timeout=timeout_s)
        time.sleep(0.2)
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return "".join(self.output)


def start_server(model_dir: Path, bind: str, *extra: str,
                 env: dict[str, str] | None = None) -> tuple[Server, str]:
    server = Server(["--model-dir", str(model_dir), "--port", "0", *extra], bind, env)
    match = server.wait_for(r"on (http://[\d.]+:\d+)", STARTUP_S)
    return server, match.group(1)


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out

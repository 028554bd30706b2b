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
from pathlib import Path

from support.deepseek_harness import CLI, tiny_tokenizer

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

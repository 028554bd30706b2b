"""What a command shows on the terminal besides its results: progress and other libraries.

`ProgressLine` is the CLI's progress display: one line per phase on stderr, rewritten in
place on a terminal. `quiet_libraries()` is called once by `cli.main()`, before any model
library is imported, so that what numaov has already handled (diffusers asking for
`accelerate`, transformers' "Loading weights" bars, exporter notes) is not shown again to
the user; with ``--log-level DEBUG`` those libraries speak and Python's warnings go to the
log. `quiet_nncf()` does the same around each NNCF weight compression, which writes to
stdout. None prints results: stdout stays the command's.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

# Carriage return, then erase to the end of the line (ANSI EL): the in-place rewrite.
CLEAR_LINE = "\r\x1b[K"


class Phase:
    """One phase of a `ProgressLine`. Calling it with a message shows the message (it is the
    ``progress`` callable the library takes); `finish` sets what the phase's last line says."""

    def __init__(self, line: ProgressLine, name: str) -> None:
        self.line, self.name = line, name
        self.outcome = "done"
        self.started = time.perf_counter()

    def __call__(self, message: str) -> None:
        self.line._show(f"{self.name}: {message}")

    def finish(self, outcome: str) -> None:
        self.outcome = outcome

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class ProgressLine:
    """Progress on ``stream`` (stderr), one line per phase.

    On a terminal each message rewrites the phase's line in place (`CLEAR_LINE`, cut to the
    terminal's width) and the phase ends on its outcome and time; elsewhere (a file, a pipe,
    a CI log) only that last line is written, one per phase. With no stream (``--quiet``)
    nothing is written. Used as a context manager, it clears the line before each log
    record, so a log line never lands in the middle of it.
    """

    def __init__(self, stream: TextIO | None, prefix: str = "numaov: ",
                 interactive: bool | None = None) -> None:
        self.stream, self.prefix = stream, prefix
        self.interactive = (stream is not None and stream.isatty()) if interactive is None \
            else interactive
        self._lock = threading.Lock()  # ranks' threads report progress too
        self._open = False  # a line without its newline is on the terminal
        self._filter = _ClearBeforeLogRecord(self)

    @contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        """``with line.phase("tiny-moe: export") as phase:``, then ``phase(message)`` as often
        as there is news and ``phase.finish(outcome)`` once."""
        phase = Phase(self, name)
        self._show(f"{name} ...")
        try:
            yield phase
        except BaseException:
            self._end(f"{name}: failed after {phase.elapsed:.1f} s")
            raise
        self._end(f"{name}: {phase.outcome} ({phase.elapsed:.1f} s)")

    def clear(self) -> None:
        """Erase the open line (it comes back with the next message)."""
        with self._lock:
            if self._open and self.stream is not None:
                self.stream.write(CLEAR_LINE)
                self.stream.flush()
                self._open = False

    def __enter__(self) -> ProgressLine:
        for handler in logging.getLogger().handlers:
            handler.addFilter(self._filter)
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self._filter)

    def _show(self, message: str) -> None:
        if self.stream is None or not self.interactive:
            return
        text = (self.prefix + message).replace("\n", " ")
        with self._lock:
            # A line wider than the terminal wraps, and the carriage return would then
            # rewrite only its last row.
            self.stream.write(CLEAR_LINE + text[:self._columns() - 1])
            self.stream.flush()
            self._open = True

    def _end(self, message: str) -> None:
        if self.stream is None:
            return
        with self._lock:
            self.stream.write((CLEAR_LINE if self.interactive else "") + self.prefix + message
                              + "\n")
            self.stream.flush()
            self._open = False

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):
            return 80


class _ClearBeforeLogRecord(logging.Filter):
    def __init__(self, line: ProgressLine) -> None:
        super().__init__()
        self.line = line

    def filter(self, record: logging.LogRecord) -> bool:
        self.line.clear()
        return True


# -- other libraries ----------------------------------------------------------------------

# Environment defaults read by these libraries when they are imported, here and in the rank
# processes (which inherit the environment); a value the user set wins.
QUIET_ENVIRONMENT = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars too
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
# Loggers and warning sources below numaov whose warnings numaov has handled.
QUIET_LOGGERS = ("diffusers", "transformers", "huggingface_hub", "torch.onnx", "torch.export",
                 "torch._export", "onnxscript", "onnx_ir")
QUIET_WARNINGS_FROM = r"(diffusers|transformers|huggingface_hub|torch\.onnx|onnxscript|onnx_ir)(\.|$)"


def quiet_libraries(log_level: int | str) -> None:
    """Keep the model libraries' warnings and progress bars off the terminal, unless the log
    level is DEBUG: then they speak as they would, and Python's warnings go to the log."""
    level = logging.getLevelName(log_level) if isinstance(log_level, str) else log_level
    if level <= logging.DEBUG:
        logging.captureWarnings(True)
        return
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=QUIET_WARNINGS_FROM)
    # A library imported before this call has read its environment already.
    for module in ("transformers", "diffusers"):
        if f"{module}.utils.logging" in sys.modules:
            library_logging = sys.modules[f"{module}.utils.logging"]
            library_logging.set_verbosity_error()
            library_logging.disable_progress_bar()
    if "huggingface_hub.utils" in sys.modules:
        sys.modules["huggingface_hub.utils"].disable_progress_bars()


@contextmanager
def quiet_nncf() -> Iterator[None]:
    """NNCF's INFO lines (its bit-width tables), its warnings and its rich progress bar, which
    it writes to stdout (the command's results), held back while NNCF compresses; when numaov
    logs at DEBUG they go to stderr instead. NNCF sets its logger up when imported, so this
    wraps each call instead of being part of `quiet_libraries()`."""
    import rich

    nncf_logger = logging.getLogger("nncf")
    console = rich.get_console()  # where NNCF's progress bars draw
    handlers = [h for h in nncf_logger.handlers if isinstance(h, logging.StreamHandler)]
    level, quiet, file = nncf_logger.level, console.quiet, console.file
    streams = [handler.stream for handler in handlers]
    if logging.getLogger("numaov").getEffectiveLevel() <= logging.DEBUG:
        console.file = sys.stderr
        for handler in handlers:
            handler.setStream(sys.stderr)
    else:
        nncf_logger.setLevel(logging.ERROR)
        console.quiet = True
    try:
        yield
    finally:
        nncf_logger.setLevel(level)
        console.quiet, console.file = quiet, file
        for handler, stream in zip(handlers, streams, strict=True):
            handler.setStream(stream)

"""numaov: diffusion transformers and MoE language models on CPU servers.

PyTorch models are exported to ONNX, converted to OpenVINO IR and run one
worker per NUMA node with shared-memory collectives between the workers.
"""

from __future__ import annotations

import re

__version__ = "0.1.0"


class NumaovError(Exception):
    """Base of every error numaov raises on purpose.

    The message names what was wrong and what was expected; the CLI prints it
    as one line and exits non-zero.

    Library messages never name a command-line flag. When the error is about
    one argument of the library call, pass its name as ``parameter`` (the name
    in the function's signature or the request's field, e.g.
    ``NumaovError("prompt ids '1,,2': ...", parameter="prompt_ids")``); the
    CLI puts the flag that sets it in front of the message
    (``--prompt-ids: prompt ids '1,,2': ...``). A parameter no flag sets
    leaves the message as it is.
    """

    def __init__(self, message: str = "", *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def exception_text(exc: BaseException, limit: int = 400,  # the reason, not a C++ call chain
                   drop: re.Pattern[str] | None = None) -> str:
    """``exc``'s text on one line (a library's multi-line message in a one-line error),
    ``drop``'s matches left out, cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    if drop is not None:
        text = drop.sub("", text)
    return text if len(text) <= limit else text[:limit] + " ..."


__all__ = ["NumaovError", "__version__", "exception_text"]

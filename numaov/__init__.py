"""numaov: diffusion transformers and MoE language models on CPU servers.

PyTorch models are exported to ONNX, converted to OpenVINO IR and run one
worker per NUMA node with shared-memory collectives between the workers.
"""

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


__all__ = ["NumaovError", "__version__"]

"""numaov: diffusion transformers and MoE language models on CPU servers.

PyTorch models are exported to ONNX, converted to OpenVINO IR and run one
worker per NUMA node with shared-memory collectives between the workers.
"""

__version__ = "0.1.0"


class NumaovError(Exception):
    """Base of every error numaov raises on purpose.

    The message names what was wrong and what was expected; the CLI prints it
    as one line and exits non-zero.
    """


__all__ = ["NumaovError", "__version__"]

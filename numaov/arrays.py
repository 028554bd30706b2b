"""numpy arrays of bfloat16 across torch and OpenVINO, without copies.

numpy has no bfloat16 of its own; ml_dtypes' (a dependency of ONNX) is a numpy dtype that
stores, copies, indexes and converts as any other, but neither ``torch.from_numpy`` nor
OpenVINO's ``Tensor`` takes it, and OpenVINO shows a bf16 tensor's memory to numpy as
float16. These functions pass arrays of every dtype across, bf16 ones by their 16-bit
patterns, sharing memory. A bf16 KV-cache pool (``manifest.CacheLayout.dtype``) is one.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# manifest.CACHE_DTYPES' names -> numpy dtypes
NUMPY_DTYPES = {"f32": np.dtype(np.float32), "bf16": BFLOAT16}


def to_torch(array: np.ndarray) -> Any:
    """``torch.from_numpy``, bf16 included (shares memory)."""
    import torch

    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def from_torch(tensor: Any) -> np.ndarray:
    """``tensor.numpy()`` of a CPU tensor, bf16 included (shares memory)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(BFLOAT16)
    return tensor.numpy()


def to_openvino(array: np.ndarray) -> Any:
    """An ``openvino.Tensor`` over ``array``'s memory (a C-contiguous array), bf16 included;
    the caller keeps ``array`` alive while the tensor is in use."""
    import openvino as ov

    if array.dtype == BFLOAT16:
        return ov.Tensor(array.view(np.uint16), ov.Shape(list(array.shape)), ov.Type.bf16)
    return ov.Tensor(array, shared_memory=True)


def from_openvino(tensor: Any) -> np.ndarray:
    """The numpy view of an ``openvino.Tensor``'s memory, a bf16 tensor as bf16."""
    import openvino as ov

    if tensor.element_type == ov.Type.bf16:
        return tensor.data.view(np.uint16).view(BFLOAT16)
    return tensor.data

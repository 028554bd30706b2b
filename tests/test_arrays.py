"""numaov.arrays: bf16 numpy arrays (ml_dtypes') into torch and OpenVINO and back, sharing
memory, and every other dtype as torch and OpenVINO take it."""

from __future__ import annotations

import numpy as np
import openvino as ov
import torch

from numaov.arrays import BFLOAT16, from_openvino, from_torch, to_openvino, to_torch


def _bf16_values() -> np.ndarray:
    # bf16 keeps 8 significant bits: these are exact, and their patterns all differ
    return (np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7.5).astype(BFLOAT16)


def test_bf16_arrays_cross_to_torch_and_back_sharing_memory() -> None:
    array = _bf16_values()
    tensor = to_torch(array)
    assert tensor.dtype == torch.bfloat16 and tensor.shape == array.shape
    assert torch.equal(tensor.float(), torch.from_numpy(array.astype(np.float32)))
    tensor[0, 0, 0] = 3.0  # shared: written through
    assert float(array[0, 0, 0]) == 3.0
    back = from_torch(tensor)
    assert back.dtype == BFLOAT16 and np.shares_memory(back.view(np.uint16), array.view(np.uint16))
    assert np.array_equal(back.astype(np.float32), array.astype(np.float32))


def test_bf16_arrays_cross_to_openvino_and_back_sharing_memory() -> None:
    array = _bf16_values()
    tensor = to_openvino(array)
    assert tensor.element_type == ov.Type.bf16 and list(tensor.shape) == list(array.shape)
    view = from_openvino(tensor)
    assert view.dtype == BFLOAT16
    assert np.array_equal(view.astype(np.float32), array.astype(np.float32))
    array[1, 2, 3] = -2.0  # shared: seen through the tensor
    assert float(from_openvino(tensor)[1, 2, 3]) == -2.0


def test_other_dtypes_pass_as_they_are() -> None:
    for dtype in (np.float32, np.int64):
        array = np.arange(6, dtype=dtype).reshape(2, 3)
        assert to_torch(array).dtype == torch.from_numpy(array).dtype
        assert from_torch(to_torch(array)).dtype == dtype
        tensor = to_openvino(array)
        assert np.array_equal(from_openvino(tensor), array)
        array[0, 0] = 9  # shared
        assert from_openvino(tensor)[0, 0] == 9
    empty = np.zeros((0, 4), dtype=BFLOAT16)  # an idle rank's entries
    assert to_torch(empty).shape == (0, 4) and list(to_openvino(empty).shape) == [0, 4]

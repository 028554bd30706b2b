"""The op registry: every op a model needs beyond plain PyTorch, with its
eager, ONNX and OpenVINO faces (see DESIGN.md)."""

from numaov.custom_ops.native import add_extension, library_path

__all__ = ["add_extension", "library_path"]

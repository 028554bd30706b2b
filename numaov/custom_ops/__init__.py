"""The op registry: every op a model needs beyond plain PyTorch, with its
eager, ONNX and OpenVINO faces (see docs/architecture.md, "Ops and their three faces")."""

from typing import Any

from numaov.custom_ops.collective_ops import (
    CollectiveOpError,
    OnnxRuntimeUnsupportedError,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    check_onnxruntime_can_run,
    reduce_scatter_tensor,
)
from numaov.custom_ops.fallback_ops import (
    FallbackOpError,
    fuse_scale_shift,
    norm_infer,
    rotary_embedding,
    rows_copy,
    scale_residual_norm_scale_shift,
)
from numaov.custom_ops.moe_ops import MoeOpError, moe_experts
from numaov.custom_ops.openvino_compile import CompiledIR, CompileError, compile_ir
from numaov.manifest import LOWERINGS
from numaov.native import add_extension, library_path


def onnx_translation_table(lowering: str = "decomposed") -> dict[Any, Any]:
    """The ``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``.

    ``lowering`` is ``"decomposed"`` (standard ops) or ``"opset23"`` (ONNX RMSNormalization /
    RotaryEmbedding); export with ``opset_version=onnx_opset_version(lowering)``. Imported
    lazily: onnxscript is only needed when exporting.
    """
    from numaov.custom_ops.collective_ops import collective_translation_table
    from numaov.custom_ops.expert_store import stored_translation_table
    from numaov.custom_ops.fallback_onnx import fallback_translation_table
    from numaov.custom_ops.moe_ops import moe_translation_table

    table = fallback_translation_table(lowering)
    table.update(collective_translation_table())
    table.update(moe_translation_table())
    table.update(stored_translation_table())
    return table


def onnx_opset_version(lowering: str = "decomposed") -> int:
    """The ``opset_version`` a lowering is exported at (``fallback_onnx.ONNX_OPSETS``)."""
    from numaov.custom_ops.fallback_onnx import onnx_opset_version as version

    return version(lowering)


__all__ = [
    "LOWERINGS",
    "CollectiveOpError",
    "CompileError",
    "CompiledIR",
    "FallbackOpError",
    "MoeOpError",
    "OnnxRuntimeUnsupportedError",
    "add_extension",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "check_onnxruntime_can_run",
    "compile_ir",
    "fuse_scale_shift",
    "library_path",
    "moe_experts",
    "norm_infer",
    "onnx_opset_version",
    "onnx_translation_table",
    "reduce_scatter_tensor",
    "rotary_embedding",
    "rows_copy",
    "scale_residual_norm_scale_shift",
]

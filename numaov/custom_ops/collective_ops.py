"""Collectives as ops: the eager face (``torch.library`` ops) and the ONNX face (nodes in domain
``numaov.collective``) of ``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``
and ``all_to_all``.

The third face, the OpenVINO ops that run those nodes, is C++ (``csrc/ops/collective_ops.cpp``,
loaded with :func:`numaov.custom_ops.add_extension`). All three faces move data through the
same shared-memory communicator, found by *group name* in the one process-wide registry (the
C++ one, which :func:`numaov.distributed.communicator.find_communicator` reads from Python and
``numaov::find_communicator`` from C++): the name is the only process-group state that crosses an
op boundary, so a traced graph, an ONNX file and an IR hold no handle and run unchanged on every
rank.

``world_size`` is an explicit argument rather than something read from the communicator because
the output shape depends on it and must be known where no communicator exists: in the fake
kernels (``torch.export``), in the ONNX node and in OpenVINO's shape inference. At run time the
op checks it against the communicator's.

Model code calls the plain functions at the bottom. While ``torch.onnx.export`` traces, they
write the ONNX node with ``torch.onnx.ops.symbolic`` (the exporter needs no translation table for
them); otherwise they dispatch to the ``numaov::`` torch ops, which are out-of-place and
functional so ``torch.export`` and ``torch.compile`` can trace them.

ONNX Runtime has no kernels for the ``numaov.collective`` domain;
:func:`check_onnxruntime_can_run` turns its obscure load error into a clear one.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from numaov import NumaovError
from numaov.custom_ops.moe_ops import MOE_DOMAIN
from numaov.distributed.communicator import CollectiveError, Communicator, find_communicator

if TYPE_CHECKING:
    import onnx

__all__ = [
    "COLLECTIVE_DOMAIN",
    "CollectiveOpError",
    "OnnxRuntimeUnsupportedError",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "check_onnxruntime_can_run",
    "reduce_scatter_tensor",
]

#: The ONNX domain of the collective nodes; the C++ extension maps the same string.
COLLECTIVE_DOMAIN = "numaov.collective"
#: Opset version written into the ONNX model for COLLECTIVE_DOMAIN.
COLLECTIVE_DOMAIN_VERSION = 1

COLLECTIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CollectiveOpError(CollectiveError):
    """A collective op was called with a group, world size, shape or dtype it cannot honour.

    A CollectiveError, so callers catch one class for everything a collective can raise.
    """


class OnnxRuntimeUnsupportedError(NumaovError):
    """An ONNX model holds numaov nodes (collectives, MoE experts), which ONNX Runtime cannot run."""


#: The ONNX domains only OpenVINO with numaov's extension runs.
OPENVINO_ONLY_DOMAINS = (COLLECTIVE_DOMAIN, MOE_DOMAIN)


# ---------------------------------------------------------------------------------------------
# Argument checks, run before dispatch so eager calls and export tracing fail the same way.
# ---------------------------------------------------------------------------------------------


def _hint(size: int | torch.SymInt) -> int | None:
    """The concrete value of a size, or None when it is unknown.

    A dynamic size during export is a SymInt; reading its hint (the example input's size)
    checks the example without adding a guard that would specialise the dynamic dimension.
    """
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else None
    return int(size)


def _check_args(op: str, x: Tensor, group: str, world_size: int, splits_dim0: bool) -> None:
    if not isinstance(group, str) or not group:
        raise CollectiveOpError(f"{op}: group is {group!r}; expected a non-empty group name")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CollectiveOpError(
            f"{op}: world_size is {world_size!r}; expected a positive int (the group's ranks)"
        )
    if x.dtype not in COLLECTIVE_DTYPES:
        raise CollectiveOpError(
            f"{op}: tensor dtype is {x.dtype}; expected torch.float32, torch.bfloat16 or "
            "torch.float16"
        )
    if x.device.type != "cpu":
        raise CollectiveOpError(f"{op}: tensor is on {x.device}; expected a CPU tensor")
    if splits_dim0 and x.dim() == 0:
        raise CollectiveOpError(
            f"{op}: tensor is a scalar; expected at least one dimension (dim 0 is split across ranks)"
        )


def _check_divisible(op: str, x: Tensor, world_size: int) -> None:
    rows = _hint(x.shape[0])
    if rows is not None and rows % world_size != 0:
        raise CollectiveOpError(
            f"{op}: dim 0 is {rows}; expected a multiple of world_size {world_size}"
        )


def _communicator(op: str, group: str, world_size: int) -> Communicator:
    """The registered communicator of `group`, checked against the world size the caller
    shaped its tensors for (a mismatch would move the wrong number of rows)."""
    comm = find_communicator(group)
    if comm.world_size != world_size:
        message = (f"{op}: called with world_size {world_size} but communicator group {group!r} "
                   f"has {comm.world_size} ranks; expected the group's world size")
        comm.fail(message)  # as OpenVINO's ops do: peers already waiting stop at once
        raise CollectiveOpError(message)
    return comm


# ---------------------------------------------------------------------------------------------
# Eager face: torch.library ops, each with its fake (shape-only) kernel right below it.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("numaov::all_reduce", mutates_args=())
def _all_reduce_op(x: Tensor, group: str, world_size: int) -> Tensor:
    # The communicator reduces in place; the op is out-of-place so it stays functional.
    out = x.contiguous().clone()
    _communicator("all_reduce", group, world_size).all_reduce(out)
    return out


@_all_reduce_op.register_fake
def _(x: Tensor, group: str, world_size: int) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("numaov::all_gather_into_tensor", mutates_args=())
def _all_gather_into_tensor_op(x: Tensor, group: str, world_size: int) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * world_size, *x.shape[1:]))
    _communicator("all_gather_into_tensor", group, world_size).all_gather_into_tensor(out, x)
    return out


@_all_gather_into_tensor_op.register_fake
def _(x: Tensor, group: str, world_size: int) -> Tensor:
    return x.new_empty((x.shape[0] * world_size, *x.shape[1:]))


@torch.library.custom_op("numaov::reduce_scatter_tensor", mutates_args=())
def _reduce_scatter_tensor_op(x: Tensor, group: str, world_size: int) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // world_size, *x.shape[1:]))
    _communicator("reduce_scatter_tensor", group, world_size).reduce_scatter_tensor(out, x)
    return out


@_reduce_scatter_tensor_op.register_fake
def _(x: Tensor, group: str, world_size: int) -> Tensor:
    return x.new_empty((x.shape[0] // world_size, *x.shape[1:]))


@torch.library.custom_op("numaov::all_to_all", mutates_args=())
def _all_to_all_op(x: Tensor, group: str, world_size: int) -> Tensor:
    x = x.contiguous()
    out = x.new_empty(x.shape)
    _communicator("all_to_all", group, world_size).all_to_all(out, x)
    return out


@_all_to_all_op.register_fake
def _(x: Tensor, group: str, world_size: int) -> Tensor:
    return x.new_empty(x.shape)


# ---------------------------------------------------------------------------------------------
# Public functions: the ONNX node while torch.onnx.export traces, the torch op otherwise.
# ---------------------------------------------------------------------------------------------


def _onnx_node(op_type: str, x: Tensor, group: str, world_size: int, shape: Any) -> Tensor:
    return torch.onnx.ops.symbolic(
        f"{COLLECTIVE_DOMAIN}::{op_type}",
        (x,),
        {"group": group, "world_size": world_size},
        dtype=x.dtype,
        shape=shape,
        version=COLLECTIVE_DOMAIN_VERSION,
    )


def all_reduce(x: Tensor, group: str, world_size: int) -> Tensor:
    """Element-wise sum of `x` over the ranks of `group`; same shape as `x`.

    Every rank must call it with the same shape and dtype. The shared-memory communicator sums
    in fp32 in rank order and rounds to nearest even, so every rank gets the same bits.
    """
    _check_args("all_reduce", x, group, world_size, splits_dim0=False)
    if torch.onnx.is_in_onnx_export():
        return _onnx_node("AllReduce", x, group, world_size, x.shape)
    return torch.ops.numaov.all_reduce(x, group, world_size)


def all_gather_into_tensor(x: Tensor, group: str, world_size: int) -> Tensor:
    """Every rank's `x` concatenated along dim 0 in rank order: ``[n, ...] -> [world_size*n, ...]``."""
    _check_args("all_gather_into_tensor", x, group, world_size, splits_dim0=True)
    if torch.onnx.is_in_onnx_export():
        shape = (x.shape[0] * world_size, *x.shape[1:])
        return _onnx_node("AllGatherIntoTensor", x, group, world_size, shape)
    return torch.ops.numaov.all_gather_into_tensor(x, group, world_size)


def reduce_scatter_tensor(x: Tensor, group: str, world_size: int) -> Tensor:
    """Sum over ranks, of which rank r keeps block r of dim 0: ``[world_size*n, ...] -> [n, ...]``.

    Dim 0 must be a multiple of `world_size`.
    """
    _check_args("reduce_scatter_tensor", x, group, world_size, splits_dim0=True)
    _check_divisible("reduce_scatter_tensor", x, world_size)
    if torch.onnx.is_in_onnx_export():
        shape = (x.shape[0] // world_size, *x.shape[1:])
        return _onnx_node("ReduceScatterTensor", x, group, world_size, shape)
    return torch.ops.numaov.reduce_scatter_tensor(x, group, world_size)


def all_to_all(x: Tensor, group: str, world_size: int) -> Tensor:
    """Block j of dim 0 goes to rank j, and block i of the result comes from rank i:
    ``[world_size*n, ...] -> [world_size*n, ...]`` (``all_to_all_single`` with equal splits).

    Dim 0 must be a multiple of `world_size`; uneven splits are not supported. For Ulysses
    sequence parallelism, a token split ``[s, heads, d]`` becomes a head split by moving the
    head groups to dim 0 (``x.view(s, world_size, heads // world_size, d).transpose(0, 1)``):
    the result ``[world_size, s, heads // world_size, d]`` holds every rank's tokens for this
    rank's heads, in rank order; the reverse exchange is the same op.
    """
    _check_args("all_to_all", x, group, world_size, splits_dim0=True)
    _check_divisible("all_to_all", x, world_size)
    if torch.onnx.is_in_onnx_export():
        return _onnx_node("AllToAll", x, group, world_size, x.shape)
    return torch.ops.numaov.all_to_all(x, group, world_size)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime refusal.
# ---------------------------------------------------------------------------------------------


def _graph_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of `graph`, including those in subgraphs (If / Loop / Scan bodies)."""
    import onnx

    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graph_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _graph_nodes(sub)


def check_onnxruntime_can_run(model: onnx.ModelProto | str | os.PathLike[str]) -> None:
    """Raise OnnxRuntimeUnsupportedError if `model` holds nodes of a numaov domain
    (``OPENVINO_ONLY_DOMAINS``: the collectives, the MoE experts).

    ONNX Runtime has no kernels for them and would fail at session creation with a message about
    an unregistered op; call this before creating an ``onnxruntime.InferenceSession``. Only the
    graph structure is read (external weights are not loaded).
    """
    import onnx

    where = ""
    if not isinstance(model, onnx.ModelProto):
        where = f" in {os.fspath(model)}"
        model = onnx.load(os.fspath(model), load_external_data=False)
    nodes = list(_graph_nodes(model.graph))
    for function in model.functions:
        nodes.extend(function.node)
    found = Counter(node.op_type for node in nodes if node.domain in OPENVINO_ONLY_DOMAINS)
    if found:
        domains = " and ".join(sorted({n.domain for n in nodes if n.domain in OPENVINO_ONLY_DOMAINS}))
        listed = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(found.items()))
        raise OnnxRuntimeUnsupportedError(
            f"ONNX Runtime cannot run {domains} nodes ({listed}){where}; "
            "use OpenVINO with the numaov extension (numaov.custom_ops.add_extension(core))"
        )


# ---------------------------------------------------------------------------------------------
# ONNX face of the captured ops: translations for torch.onnx.export of an ExportedProgram.
# ---------------------------------------------------------------------------------------------


def collective_translation_table() -> dict[Any, Any]:
    """``{torch op overload: onnxscript function}`` writing the ``numaov.collective`` nodes.

    Needed when the program is captured with ``torch.export`` *before* ``torch.onnx.export``
    sees it (what ``numaov.exporter.onnx_export`` does, so that a specialised dynamic axis is
    an error): ``is_in_onnx_export()`` is then False during capture, the public functions above
    dispatch to the ``numaov::`` torch ops, and those need a translation. The nodes are the
    same as the ones ``_onnx_node`` writes. Imported lazily: onnx and onnxscript are only
    needed when exporting.
    """
    from onnx.defs import OpSchema
    from onnxscript.values import Op, Opset

    opset = Opset(COLLECTIVE_DOMAIN, COLLECTIVE_DOMAIN_VERSION)

    def node(op_type: str) -> Op:
        # The domain is not registered with onnx, so onnxscript needs the schema given.
        schema = OpSchema(
            op_type, COLLECTIVE_DOMAIN, COLLECTIVE_DOMAIN_VERSION,
            inputs=[OpSchema.FormalParameter("x", "T")],
            outputs=[OpSchema.FormalParameter("y", "T")],
            type_constraints=[("T", ["tensor(float)", "tensor(bfloat16)", "tensor(float16)"],
                               "the dtypes the communicator reduces")],
            attributes=[OpSchema.Attribute("group", OpSchema.AttrType.STRING, "group name"),
                        OpSchema.Attribute("world_size", OpSchema.AttrType.INT, "ranks")],
        )
        return Op(opset, op_type, schema)

    all_reduce_node = node("AllReduce")
    all_gather_node = node("AllGatherIntoTensor")
    reduce_scatter_node = node("ReduceScatterTensor")
    all_to_all_node = node("AllToAll")

    def all_reduce_onnx(x, group: str, world_size: int):
        return all_reduce_node(x, group=group, world_size=world_size)

    def all_gather_onnx(x, group: str, world_size: int):
        return all_gather_node(x, group=group, world_size=world_size)

    def reduce_scatter_onnx(x, group: str, world_size: int):
        return reduce_scatter_node(x, group=group, world_size=world_size)

    def all_to_all_onnx(x, group: str, world_size: int):
        return all_to_all_node(x, group=group, world_size=world_size)

    ops = torch.ops.numaov
    return {
        ops.all_reduce.default: all_reduce_onnx,
        ops.all_gather_into_tensor.default: all_gather_onnx,
        ops.reduce_scatter_tensor.default: reduce_scatter_onnx,
        ops.all_to_all.default: all_to_all_onnx,
    }

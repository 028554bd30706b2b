"""The one way numaov compiles an OpenVINO model on the CPU.

Every compile goes through `compile_ir`: the runtime's workers, both exporters' parity
checks and the benchmarks. So the graph an export's parity measures is the graph that runs,
with the same four steps in the same order:

1. read the IR with numaov's extension ops loaded (the collectives, FlashAttention, the MoE
   experts) and open the expert stores its ``MoeExperts`` nodes name (``expert_store``);
2. at bf16, swap plain attention for numaov's flash-attention kernel when
   ``NUMAOV_ATTENTION`` allows it (`flash_attention.attention_kernel`);
3. at bf16 on a CPU that computes in bf16, give the MoE experts bf16 activations
   (`_moe_activations_in_bf16`) and compute batched bf16 weights' MatMuls in bf16
   (`_batched_weights_in_bf16`);
4. compile with ``INFERENCE_PRECISION_HINT`` set: an f32 model must say f32, or OpenVINO
   runs it in bf16 on CPUs with AVX512-BF16 / AMX.

OpenVINO's read and compile errors are many lines of C++ context; they become one
`CompileError` naming the file.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError, exception_text
from numaov.arrays import BFLOAT16, from_openvino, to_openvino
from numaov.custom_ops.expert_store import open_stores_of
from numaov.custom_ops.flash_attention import attention_kernel, swap_attention
from numaov.native import add_extension

INFERENCE_PRECISIONS = ("f32", "bf16")
PRECISION_HINT = "INFERENCE_PRECISION_HINT"


class CompileError(NumaovError):
    """OpenVINO could not read or compile a model."""


@dataclass(frozen=True)
class GraphPart:
    """A part of a graph to compile on its own: the graph outputs ``outputs``, computed from
    the graph's inputs and from the graph outputs named in ``feeds``, which become inputs of
    the same name (their producers, and whatever only they need, are left out). A model that
    exports its intermediate states as outputs can so run in pieces: the Wan transformer's
    step caches run its head alone (patch embedding, and first block), the whole step, or
    only the output head."""

    outputs: tuple[str, ...]
    feeds: tuple[str, ...] = ()

    def __str__(self) -> str:
        fed = f" from {', '.join(self.feeds)}" if self.feeds else ""
        return f"the part giving {', '.join(self.outputs)}{fed}"

    def of(self, model: Any) -> Any:
        """The part as a new ``openvino.Model`` (``model`` is edited: pass a clone)."""
        import openvino as ov

        results = {name: result for result in model.get_results()
                   for name in result.output(0).get_names()}
        missing = [n for n in (*self.outputs, *self.feeds) if n not in results]
        if missing:
            raise ValueError(f"the graph has no output {', '.join(missing)} (it has "
                             f"{', '.join(sorted(results))})")
        fed = []
        for name in self.feeds:
            source = results[name].input_value(0)
            parameter = ov.opset13.parameter(source.get_partial_shape(),
                                             source.get_element_type(), name=name)
            parameter.output(0).set_names({name})
            for target in list(source.get_target_inputs()):
                if target.get_node() is not results[name]:
                    target.replace_source_output(parameter.output(0))
            fed.append(parameter)
        kept = [results[name] for name in self.outputs]
        needed = _reachable(kept)
        parameters = [p for p in model.get_parameters() if p in needed] + fed
        return ov.Model(kept, parameters, model.get_friendly_name())


def _reachable(results: list[Any]) -> set[Any]:
    """Every node the ``results`` depend on."""
    seen, stack = set(), list(results)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(value.get_node() for value in node.input_values())
    return seen


_MADV_DONTNEED = 4


def release_weight_pages(bin_path: str | Path) -> int:
    """Drop this process's resident pages of an IR's ``.bin`` that OpenVINO maps, once the
    compiled model has run: the CPU plugin reads the mapped weights when it packs them at the
    first inference and not after, so they held a second copy of the weights in the
    process's memory for nothing (measured: a 403 MB bf16 Wan transformer at 656 MiB
    anonymous plus 527 MiB of the mapped file after a step; 124 MiB of file after this, the
    next step the same, its outputs equal). A page read again later comes back from the file
    (``MADV_DONTNEED`` on a file mapping), so nothing can go wrong but the memory; a writable
    mapping, whose pages may have been written (a private copy), is left alone.
    Returns the bytes released; 0 where ``/proc`` or ``madvise`` is not available."""
    import os

    madvise = _madvise()
    if madvise is None:
        return 0
    released = 0
    for start, end in _read_only_mappings(os.path.realpath(bin_path)):
        if madvise(start, end - start, _MADV_DONTNEED) == 0:
            released += end - start
    return released


def _read_only_mappings(target: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each of this process's read-only mappings of file ``target``, from
    ``/proc/self/maps``. Read-only, so no page of it was ever written (a private copy would
    be lost to ``MADV_DONTNEED``); a writable mapping is left alone. Not ``smaps``: the
    kernel walks every mapping's pages to write it, 20 ms a read in a process running
    OpenVINO, and a run lets go of several graphs' pages."""
    try:
        with open("/proc/self/maps") as maps:
            lines = [line.split() for line in maps if target in line]
    except OSError:
        return []
    return [tuple(int(x, 16) for x in head[0].split("-")) for head in lines
            if len(head) >= 6 and head[5] == target and "w" not in head[1]]


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise``, or None where there is no libc to load."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    madvise = ctypes.CDLL(name, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


class WeightPages:
    """The mapped weights of one or more IRs (their ``.bin`` files), let go with
    ``release_weight_pages`` the first time each compiled model of them has run
    (``after_run(key)``, one key per compiled model or part): a compiled model packs its
    weights at its first inference, so until each has run the pages may still be read."""

    def __init__(self, *bin_paths: str | Path) -> None:
        self._paths = bin_paths
        self._ran: set[object] = set()

    def after_run(self, key: object = None) -> None:
        if key not in self._ran:
            self._ran.add(key)
            for path in self._paths:
                release_weight_pages(path)


@dataclass(frozen=True)
class CompiledIR:
    """A compiled model and the attention kernel its plain attention nodes run on."""

    model: Any  # openvino.CompiledModel
    # "numaov" when at least one attention node runs numaov's kernel, else "openvino".
    attention: str
    swapped: int

    def create_infer_request(self) -> Any:
        return self.model.create_infer_request()

    @property
    def outputs(self) -> Any:
        return self.model.outputs

    def runner(self) -> Callable[[dict[str, Any]], list[Any]]:
        """A function running one set of named input arrays on a fresh infer request and
        returning copies of every output, in order (the request reuses its buffers)."""
        request = self.create_infer_request()
        count = len(self.outputs)

        def run(feeds: dict[str, Any]) -> list[Any]:
            infer(request, feeds)
            return [np.array(from_openvino(request.get_output_tensor(i))) for i in range(count)]

        return run


class InferError(NumaovError, RuntimeError):
    """An inference failed inside OpenVINO (one of numaov's ops in the graph among the
    causes: a collective whose peer died or timed out, an expert store not open). Still a
    ``RuntimeError``, as OpenVINO's own error is."""


# OpenVINO prefixes its message with the source location of every level it passed through.
_OPENVINO_LOCATION = re.compile(r"Exception from \S+:\d+:\s*")
_MAX_INFER_CAUSE_CHARS = 1200


def infer(request: Any, feeds: dict[str, Any]) -> None:
    """``request.infer(feeds)``, its failure one line: OpenVINO raises a ``RuntimeError``
    whose text spans many lines, numaov's op's own message inside, after the source
    locations OpenVINO adds (left out here). A bf16 input takes a bf16 array
    (``numaov.arrays``) or a float one, rounded to bf16 (as a reference sample stores it)."""
    import openvino as ov

    tensors = {}
    for name, array in feeds.items():
        if isinstance(array, np.ndarray) and array.dtype.kind == "f" \
                and request.get_tensor(name).element_type == ov.Type.bf16:
            array = np.ascontiguousarray(array, dtype=BFLOAT16)
        tensors[name] = to_openvino(array) if getattr(array, "dtype", None) == BFLOAT16 \
            else array
    try:
        request.infer(tensors)
    except RuntimeError as exc:
        cause = exception_text(exc, _MAX_INFER_CAUSE_CHARS, _OPENVINO_LOCATION)
        raise InferError(f"OpenVINO inference failed: {cause}") from exc


def _precision_name(precision: Any) -> str:
    """``"bf16"`` from ``"bf16"`` or ``openvino.Type.bf16``; checked."""
    name = getattr(precision, "get_type_name", None)
    value = name() if callable(name) else str(precision)
    if value not in INFERENCE_PRECISIONS:
        raise CompileError(
            f"inference precision {precision!r}; expected one of {', '.join(INFERENCE_PRECISIONS)}"
        )
    return value


def effective_precision(precision: Any, properties: Mapping[str, Any] | None = None) -> str:
    """The inference precision a compile runs at: ``INFERENCE_PRECISION_HINT`` among
    ``properties`` wins over ``precision``."""
    return _precision_name((properties or {}).get(PRECISION_HINT, precision))


def _moe_activations_in_bf16(model: Any) -> int:
    """Give every ``MoeExperts`` and ``DenseLinear`` node (the experts' kernel) of a model the
    CPU plugin computes in bf16 bf16
    activations: its f32 x through a Convert to bf16, its output through a Convert back to f32.
    The plugin computes the nodes around it in bf16, but runs an extension op on the types the
    graph gives it, so without these it converts x to f32 and the result back (a Reorder each
    way) and the kernel cannot tell that the model computes in bf16: with bf16 x, fp8 experts
    of many rows run on the bf16 tiles (``moe_kernels.hpp``); every other path gives the same
    values either way (x is bf16-valued, and the output is rounded to bf16 by the next node).
    Done when compiling, not in the IR, so an IR compiled at f32 keeps f32 activations.
    Returns how many nodes were given bf16 activations."""
    import openvino as ov

    nodes = [node for node in model.get_ordered_ops()
             if node.get_type_name() in ("MoeExperts", "DenseLinear")
             and node.get_input_element_type(0) == ov.Type.f32]
    return _compute_in_bf16(model, nodes, (0,))


def _compute_in_bf16(model: Any, nodes: list[Any], ports: tuple[int, ...]) -> int:
    """Give each of ``nodes`` its inputs ``ports`` through a Convert to bf16 and its f32 output
    through a Convert back, so the node computes in bf16 and its consumers see f32 as before.
    Returns how many nodes."""
    import openvino as ov
    from openvino import opset13 as ops

    for node in nodes:
        targets = list(node.output(0).get_target_inputs())
        for port in ports:
            node.input(port).replace_source_output(
                ops.convert(node.input_value(port), ov.Type.bf16).output(0))
        node.validate_and_infer_types()
        back = ops.convert(node.output(0), ov.Type.f32)
        for target in targets:
            target.replace_source_output(back.output(0))
    if nodes:
        model.validate_nodes_and_infer_types()
    return len(nodes)


# The ops on a weight's way from its constants to a MatMul (a type and a shape: the exporter's
# views of it, and the shape arithmetic of those views).
_WEIGHT_PATH_OPS = frozenset({"Constant", "Convert", "Reshape", "Transpose", "Slice",
                              "StridedSlice", "Split", "VariadicSplit", "Squeeze", "Unsqueeze",
                              "Concat"})


def _batched(shape: Any) -> bool:
    """Whether a weight of this (partial) shape is batched: of a known rank of 3 or more."""
    return shape.rank.is_static and shape.rank.get_length() >= 3


def _bf16_weight(value: Any) -> bool:
    """Whether ``value`` is computed from constants alone through shape ops, and its values are
    bf16 ones (a bf16 export's weight, widened to f32 where it is used): its floating constants
    are bf16, and every Convert to a floating type on the way converts from bf16 or f32 (not
    from integers, whose values bf16 may not hold)."""
    import openvino as ov

    seen, stack, floats = set(), [value.get_node()], []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        kind, out = node.get_type_name(), node.get_output_element_type(0)
        if kind not in _WEIGHT_PATH_OPS:
            return False
        if kind == "Constant" and out.is_real():
            floats.append(out)
        if kind == "Convert" and out.is_real() and node.get_input_element_type(0) not in (
                ov.Type.bf16, ov.Type.f32):
            return False
        stack.extend(v.get_node() for v in node.input_values())
    return bool(floats) and all(t == ov.Type.bf16 for t in floats)


def _batched_weights_in_bf16(model: Any) -> int:
    """Compute in bf16 every f32 MatMul whose second input is a batched (rank >= 3) bf16
    weight: MLA's absorbed ``kv_b_proj`` halves, ``[heads, nope, R]`` and ``[heads, v, R]``.
    The CPU plugin runs a 2-D constant weight as a ``FullyConnected`` that reads it bf16, but
    keeps a MatMul with a batched constant weight in f32 at bf16 precision: it folds the
    weight's widening into an f32 copy and reads twice the bytes (measured on the
    DeepSeek-V3-shaped step: 0.12-0.14 ms per 16-head matmul, 4 MB f32, against 0.06-0.07 ms
    in bf16; at V3's 128 heads 4 GB a token across 61 layers against 2 GB). Its activation
    goes through a Convert to bf16 and its weight back to bf16 (exact: the values were bf16),
    its output through a Convert to f32; the rest of the model computes in bf16 already, so
    the results are those of bf16 inference. Returns how many MatMuls were changed."""
    import openvino as ov

    nodes = [node for node in model.get_ordered_ops()
             if node.get_type_name() == "MatMul" and node.get_output_element_type(0) == ov.Type.f32
             and _batched(node.get_input_partial_shape(1)) and _bf16_weight(node.input_value(1))]
    return _compute_in_bf16(model, nodes, (0, 1))


def _bf16_tensors(model: Any, prefixes: tuple[str, ...]) -> Any:
    """``model`` with the inputs and outputs whose names start with one of ``prefixes`` as
    bf16 tensors (OpenVINO's pre/post-processing: the graph inside is unchanged)."""
    import openvino as ov
    from openvino.preprocess import PrePostProcessor

    ppp = PrePostProcessor(model)
    for ports, side in ((model.inputs, ppp.input), (model.outputs, ppp.output)):
        for i, port in enumerate(ports):
            if port.get_any_name().startswith(prefixes):
                side(i).tensor().set_element_type(ov.Type.bf16)
    return ppp.build()


def compile_ir(
    source: str | Path | Any,
    precision: str,
    properties: Mapping[str, Any] | None = None,
    attention: str | None = None,
    bf16_io: tuple[str, ...] = (),
    part: GraphPart | None = None,
) -> CompiledIR:
    """Compile ``source`` (an ``.xml`` path, or an ``openvino.Model``, which is left as it
    is) for the CPU at inference ``precision`` (``"f32"`` / ``"bf16"``).

    ``properties`` are further OpenVINO CPU properties (threads, pinning, ...); an
    ``INFERENCE_PRECISION_HINT`` among them wins over ``precision`` and decides the
    attention kernel. ``attention`` overrides ``NUMAOV_ATTENTION`` (same values), so a
    benchmark can compile both kernels in one process. ``bf16_io``: name prefixes of inputs
    and outputs exchanged as bf16 tensors when the effective precision is bf16 (state a loop
    passes from one call to the next, which then needs no conversion either way). Raises
    `CompileError` naming the file on any OpenVINO failure, and ``AttentionSettingError`` for
    a bad attention setting. ``part`` compiles a part of the graph (`GraphPart`).
    """
    import openvino as ov

    effective = effective_precision(precision, properties)
    config = {**(properties or {}), PRECISION_HINT: effective}
    kernel = attention_kernel(effective, attention)  # checks NUMAOV_ATTENTION before any slow work
    core = ov.Core()
    add_extension(core)
    if isinstance(source, (str, Path)):
        name = repr(str(source))
        if not Path(source).is_file():
            raise CompileError(f"OpenVINO model {name} does not exist; expected an IR .xml file")
        try:
            model = core.read_model(str(source))
        except Exception as exc:  # OpenVINO raises RuntimeError subclasses with long text
            raise CompileError(
                f"OpenVINO cannot read {name} (corrupt or truncated IR?): {exception_text(exc)}"
            ) from exc
        # the routed experts the graph names live in its directory's expert store
        open_stores_of(model, Path(source).parent)
    # the plugin computes this model in bf16: its bf16 edits apply (a CPU without bf16 runs a
    # bf16 hint in f32)
    computes_bf16 = (effective == "bf16"
                     and "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    if not isinstance(source, (str, Path)):
        name = f"model {source.get_friendly_name()!r}"
        # the caller's model is left as it is: swapping, the bf16 edits and pre/post-processing
        # edit a copy (which shares the constants)
        edits = kernel == "numaov" or bf16_io or part or computes_bf16
        model = source.clone() if edits else source
    if part is not None:
        try:
            model = part.of(model)
        except Exception as exc:
            raise CompileError(f"cannot take {part} of {name}: {exception_text(exc)}") from exc
    swapped = swap_attention(model) if kernel == "numaov" else 0
    if computes_bf16:
        try:
            _moe_activations_in_bf16(model)
            _batched_weights_in_bf16(model)
        except Exception as exc:
            raise CompileError(f"OpenVINO cannot give {name} its bf16 computations: "
                               f"{exception_text(exc)}") from exc
    if bf16_io and effective == "bf16":
        try:
            model = _bf16_tensors(model, bf16_io)
        except Exception as exc:
            raise CompileError(f"OpenVINO cannot set bf16 inputs and outputs of {name}: "
                               f"{exception_text(exc)}") from exc
    try:
        compiled = core.compile_model(model, "CPU", config)
    except Exception as exc:
        raise CompileError(f"OpenVINO cannot compile {name}: {exception_text(exc)}") from exc
    return CompiledIR(compiled, "numaov" if swapped else "openvino", swapped)

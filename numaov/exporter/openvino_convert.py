"""ONNX -> OpenVINO IR (``.xml`` graph + ``.bin`` weights), with numaov's extension loaded.

The extension library is loaded before the ONNX frontend reads the graph so that the
``numaov.collective`` nodes map to numaov's C++ ops; a graph without such nodes converts
the same either way.

Precision (what ``"bf16"`` does, precisely):

- ``"f32"``: weights stay f32 in the IR. Everything compiles it with
  ``INFERENCE_PRECISION_HINT=f32`` (``numaov.custom_ops.compile_ir``): without it OpenVINO
  picks bf16 on CPUs with AVX512-BF16 or AMX, and the f32 export would silently run in bf16.
- ``"bf16"``: every f32 weight constant of ``BF16_MIN_ELEMENTS`` elements or more is stored
  in the IR as bf16 followed by a Convert back to f32, which halves the ``.bin``. Each such
  Convert is marked as a weight decompression (``_mark_weight_decompression``), so the CPU
  plugin keeps the weight bf16 when it compiles rather than folding it into an f32 copy;
  the compute precision comes from ``INFERENCE_PRECISION_HINT=bf16``, under which matmuls
  and attention run in bf16 (norms and softmax accumulate in f32), but for the MoE routers'
  nodes, kept f32 (``_keep_routing_f32``). The graph inputs and
  outputs stay f32 either way, so callers never handle bf16 arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.manifest import PRECISIONS

logger = logging.getLogger(__name__)

# The OpenVINO inference precision each export precision is compiled with.
INFERENCE_PRECISION = {"f32": "f32", "bf16": "bf16"}
# Smaller constants are shape arithmetic, norm epsilons and the like: left in f32,
# since rounding them buys nothing and could change integer-valued shape data.
BF16_MIN_ELEMENTS = 1024


class ConversionError(NumaovError):
    """The ONNX model could not be converted to OpenVINO IR."""


def check_precision(precision: str) -> str:
    """The export entry points' check of a requested precision (``export_wan``,
    ``export_lm``); the stages below them take it as checked."""
    if precision not in PRECISIONS:
        raise ConversionError(
            f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}",
            parameter="precision",
        )
    return precision


def _subgraphs(node) -> list:
    """The bodies of a node that holds graphs (If / Loop): their weights are stored like the
    main graph's. No numaov model writes one today (the MoE experts are one MoeExperts node);
    kept so bf16 storage is complete for any graph that does."""
    kind = node.get_type_name()
    if kind == "If":
        return [node.get_then_body(), node.get_else_body()]
    if kind in ("Loop", "TensorIterator"):
        return [node.get_function(0)]  # index 0 is their only body; others crash
    return []


# The input ports of numaov's ops on the experts' kernel that read a weight in place in its
# stored format (MoeExperts' stacks, DenseLinear's weight), then those of its f32 scales.
_STORED_WEIGHT_PORTS = {"MoeExperts": ((3, 4), (5, 6)), "DenseLinear": ((1,), (2,))}


def _stored_input(target, scales: bool) -> bool:
    """Whether an input port is a stored weight of numaov's MoeExperts / DenseLinear (read in
    place in its stored format, so it gets the bf16 constant itself with no Convert for the
    plugin to fold back to f32) or, with ``scales``, that weight's f32 scales (part of the
    stored format, kept f32: rounded to bf16 they moved a layer's output by 1%)."""
    ports = _STORED_WEIGHT_PORTS.get(target.get_node().get_type_name())
    return ports is not None and target.get_index() in ports[int(scales)]


# Values rounded per step of _bf16_constant: bounds its temporaries (a few copies of one chunk).
_BF16_CHUNK = 1 << 22


def _bf16_constant(values: np.ndarray) -> Any:
    """An ``openvino`` bf16 Constant of the f32 ``values``, rounded to nearest even as
    ``torch.Tensor.bfloat16`` rounds (weights are finite: the loader checked them). Written
    chunk by chunk into the constant's own buffer: ``opset.constant(values, dtype=bf16)``
    took 8 GiB and 55 s for 2 GiB of f32 weights, this takes the bf16 bytes."""
    import openvino as ov

    from numaov.arrays import BFLOAT16, from_openvino

    tensor = ov.Tensor(ov.Type.bf16, list(values.shape))
    out = from_openvino(tensor).reshape(-1)
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    for start in range(0, flat.size, _BF16_CHUNK):
        # ml_dtypes' conversion rounds to nearest even: the same bits as torch's
        out[start:start + _BF16_CHUNK] = flat[start:start + _BF16_CHUNK].astype(BFLOAT16)
    return ov.op.Constant(tensor, shared_memory=False)


def _store_weights_as_bf16(model) -> int:
    """Replace big f32 constants with bf16 constants plus a Convert to f32, in the graph and
    in every subgraph body; returns the count."""
    import openvino as ov
    from openvino import opset13 as ops

    replaced = 0
    for node in model.get_ordered_ops():
        for body in _subgraphs(node):
            replaced += _store_weights_as_bf16(body)
        if node.get_type_name() != "Constant" or node.get_element_type() != ov.Type.f32:
            continue
        shape = node.get_output_partial_shape(0)
        if not shape.is_static or int(np.prod(list(node.get_output_shape(0)))) < BF16_MIN_ELEMENTS:
            continue
        if any(_stored_input(t, scales=True) for t in node.output(0).get_target_inputs()):
            continue
        compressed = _bf16_constant(node.get_data())
        compressed.set_friendly_name(node.get_friendly_name())
        expanded = None
        for target in list(node.output(0).get_target_inputs()):
            if _stored_input(target, scales=False):
                target.replace_source_output(compressed.output(0))
                continue
            if expanded is None:
                expanded = ops.convert(compressed, ov.Type.f32)
            target.replace_source_output(expanded.output(0))
        replaced += 1
    model.validate_nodes_and_infer_types()
    return replaced


def _has_attribute(layer: Any, name: str) -> bool:
    """Whether an IR layer (an XML element) has the runtime attribute ``name``."""
    rt_info = layer.find("rt_info")
    return rt_info is not None and any(a.get("name") == name
                                       for a in rt_info.findall("attribute"))


def _add_attribute(layer: Any, name: str) -> bool:
    """Give an IR layer (an XML element) the runtime attribute ``name`` (version 0) unless it
    has it; the IR reader turns it into OpenVINO's attribute of that name. Whether it was
    added."""
    import xml.etree.ElementTree as ET

    if _has_attribute(layer, name):
        return False
    rt_info = layer.find("rt_info")
    if rt_info is None:
        rt_info = ET.Element("rt_info")
        layer.insert(1, rt_info)
    ET.SubElement(rt_info, "attribute", {"name": name, "version": "0"})
    return True


def _mark_weight_decompression(xml_path: Path) -> int:
    """Mark every Convert of a bf16 Constant in the saved IR as a weight decompression (the
    ``decompression`` runtime attribute OpenVINO writes on the Converts of its own f16
    compression), so the CPU plugin keeps the weights bf16 when it compiles instead of folding
    each Convert into an f32 copy: measured on an [8192, 8192] weight, 135 MiB against 391 MiB
    compiled at bf16, the same outputs. OpenVINO's Python API cannot set the attribute, so it
    is written into the IR's XML, which the reader then turns into the attribute. A Convert
    kept ``precise`` (a router's weight, ``_keep_routing_f32``) is left to fold into f32.
    Returns how many Converts were marked."""
    import xml.etree.ElementTree as ET

    tree = ET.parse(xml_path)
    marked = 0
    # the graph and every body (If / Loop), each with its own layer ids
    for graph in [tree.getroot(), *tree.getroot().iter("body")]:
        layers, edges = graph.find("layers"), graph.find("edges")
        if layers is None or edges is None:
            continue
        constants = {layer.get("id") for layer in layers.findall("layer")
                     if layer.get("type") == "Const"
                     and layer.find("data") is not None
                     and layer.find("data").get("element_type") == "bf16"}
        fed = {edge.get("to-layer") for edge in edges.findall("edge")
               if edge.get("from-layer") in constants}
        for layer in layers.findall("layer"):
            if layer.get("type") == "Convert" and layer.get("id") in fed \
                    and not _has_attribute(layer, "precise"):
                marked += _add_attribute(layer, "decompression")
    tree.write(xml_path, encoding="utf-8", xml_declaration=True)
    return marked


def _keep_f32_from(xml_path: Path, inputs: tuple[str, ...]) -> int:
    """Mark every node of the saved IR computed from the graph inputs ``inputs`` alone (with
    constants) as ``precise``, the attribute under which OpenVINO keeps a node in f32 when it
    compiles for bf16: the Wan transformer's timestep path. Its sinusoids take angles up to
    1000 radians, and a bf16 product (8 significant bits) of the timestep and a frequency is
    off by up to 2 radians: measured, that made every block's bf16 output 2-4.5% (RMS) off
    at timestep 999, 0.2-0.4% with these nodes in f32. They are vectors per sample, so
    keeping them f32 costs nothing. Returns how many nodes were marked."""
    import xml.etree.ElementTree as ET

    tree = ET.parse(xml_path)
    graph = tree.getroot()
    layers = {layer.get("id"): layer for layer in graph.find("layers").findall("layer")}
    consumers: dict[str, list[str]] = {}
    for edge in graph.find("edges").findall("edge"):
        consumers.setdefault(edge.get("from-layer"), []).append(edge.get("to-layer"))

    def reached(names) -> set[str]:
        todo = [i for i, layer in layers.items()
                if layer.get("type") == "Parameter" and layer.get("name") in names]
        seen: set[str] = set()
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(consumers.get(node, []))
        return seen

    others = {layer.get("name") for layer in layers.values()
              if layer.get("type") == "Parameter"} - set(inputs)
    marked = 0
    for node in reached(inputs) - reached(others):
        layer = layers[node]
        if layer.get("type") not in ("Parameter", "Result"):
            marked += _add_attribute(layer, "precise")
    tree.write(xml_path, encoding="utf-8", xml_declaration=True)
    return marked


# The MoeExperts inputs the router computes (``moe_ops``: x, ids, weights, then the stacks).
_ROUTING_PORTS = ("1", "2")
# Where the walk back from them stops, unmarked: shape arithmetic, inputs and constants. (It
# also stops at the router's own matmul, marked: its activation input is the model's hidden
# state, computed at the model's precision like every other matmul input; and at numaov's
# own ops, which are not the router's float computations.)
_ROUTING_BOUNDARY = ("ShapeOf", "Parameter", "Const")


def _keep_routing_f32(xml_path: Path) -> int:
    """Mark the nodes that compute every ``MoeExperts`` node's expert ids and weights in the
    saved IR (the router: its matmul, softmax or sigmoid, correction bias, group choice, top-k,
    renormalisation and scaling) as ``precise``, so a bf16 compilation keeps them f32 as
    transformers does (``router.py``: bf16 scores flip near-tied experts, and DeepSeek-V3's
    sigmoid scores near 0.5-1 round to steps of 0.002-0.004 in bf16, the size of its
    correction biases' differences). Measured on tiny random V3 / Qwen3 checkpoints before
    this: 12 and 4 of 144 teacher-forced bf16 steps more than 0.2 off transformers' f32
    logits, against 4 and 1 for transformers' own bf16. Returns how many nodes were marked."""
    import xml.etree.ElementTree as ET

    tree = ET.parse(xml_path)
    graph = tree.getroot()
    layers = {layer.get("id"): layer for layer in graph.find("layers").findall("layer")}
    producers: dict[tuple[str, str], str] = {}
    for edge in graph.find("edges").findall("edge"):
        producers[(edge.get("to-layer"), edge.get("to-port"))] = edge.get("from-layer")

    def inputs_of(node: str) -> list[str]:
        ports = layers[node].find("input")
        return [] if ports is None else [
            producers[(node, port.get("id"))] for port in ports.findall("port")
            if (node, port.get("id")) in producers]

    todo = [producers[(node, port)] for node, layer in layers.items()
            if layer.get("type") == "MoeExperts" for port in _ROUTING_PORTS
            if (node, port) in producers]
    seen: set[str] = set()
    marked = 0
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        kind = layers[node].get("type")
        if kind in _ROUTING_BOUNDARY or not layers[node].get("version", "").startswith("opset"):
            continue
        marked += _add_attribute(layers[node], "precise")
        if kind != "MatMul":
            todo.extend(inputs_of(node))
            continue
        # The router's weight: the CPU plugin runs a matmul of a weight marked as a bf16
        # decompression in bf16 whatever the matmul's own mark, so its Convert is kept
        # precise, which _mark_weight_decompression leaves unmarked (folded into an f32 copy
        # when compiled: E x H values).
        for weight in inputs_of(node):
            if layers[weight].get("type") == "Convert" and all(
                    layers[i].get("type") == "Const" for i in inputs_of(weight)):
                marked += _add_attribute(layers[weight], "precise")
    tree.write(xml_path, encoding="utf-8", xml_declaration=True)
    return marked


def convert_to_ir(
    onnx_path: str | Path,
    xml_path: str | Path,
    precision: str = "f32",
    progress: Callable[[str], None] | None = None,
    compress: Callable[[Any], None] | None = None,
    keep_weight_casts: bool = False,
    f32_inputs: tuple[str, ...] = (),
    computes_in_bf16: bool | None = None,
) -> Path:
    """Convert ``onnx_path`` to ``xml_path`` (+ ``.bin``); returns the ``.xml`` path.

    ``compress``, when given, is applied to the converted ``openvino.Model`` before it is
    saved (the int8 / int4 weight compression of ``weight_formats``). ``precision`` is one of
    ``PRECISIONS``, checked by the export entry point that calls this (``check_precision``).
    ``keep_weight_casts``: the graph's weights are bf16 with a Cast to f32 where they are
    used (a language-model export of a bf16 checkpoint, ``models.checkpoint.compute_in_f32``):
    convert with the ONNX frontend alone, without ``convert_model``'s graph transformations,
    which fold every such Cast into an f32 copy of the weight (2x the weights in memory, the
    CPU plugin folds it when it compiles anyway), so the IR stores the bf16 weights as read.
    ``f32_inputs``: graph inputs whose own computations (the nodes that depend on them and on
    no other input) stay f32 at bf16 (``_keep_f32_from``; the Wan transformer's timestep).
    ``computes_in_bf16``: the IR will be compiled at bf16 (default: when ``precision`` is), so
    its MoE routers are kept f32 (``_keep_routing_f32``): an int8 / int4 export stores its other
    weights through NNCF, not bf16, and still computes in bf16."""
    import openvino as ov

    from numaov.custom_ops import library_path

    assert precision in PRECISIONS, f"unknown precision {precision!r}; expected one of " \
        f"{', '.join(PRECISIONS)}"
    onnx_path, xml_path = Path(onnx_path), Path(xml_path)
    if not onnx_path.is_file():
        raise ConversionError(f"ONNX model {str(onnx_path)!r} not found")
    if xml_path.suffix != ".xml":
        raise ConversionError(f"IR output path {str(xml_path)!r} must end in .xml")
    report = progress or (lambda _msg: None)

    report(f"converting {onnx_path.name} to OpenVINO IR ({precision})")
    try:
        if keep_weight_casts:
            from openvino.frontend import FrontEndManager

            frontend = FrontEndManager().load_by_framework("onnx")
            frontend.add_extension(str(library_path()))
            model = frontend.convert(frontend.load(str(onnx_path)))
        else:
            model = ov.convert_model(str(onnx_path), extension=str(library_path()))
    except NumaovError:
        raise
    except Exception as exc:  # OpenVINO raises its own RuntimeError subclasses with long text
        raise ConversionError(f"OpenVINO could not convert {str(onnx_path)!r}: {exc}") from exc
    if precision == "bf16":
        replaced = _store_weights_as_bf16(model)
        report(f"stored {replaced} weight tensors as bf16")
    if compress is not None:
        report("compressing weights")
        compress(model)
    xml_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # compress_to_fp16 must be off: its default (on) would store f16 weights, which
        # neither precision asks for (f16 overflows above 65504 and is not what bf16 means).
        ov.save_model(model, str(xml_path), compress_to_fp16=False)
    except Exception as exc:
        raise ConversionError(f"cannot write OpenVINO IR to {str(xml_path)!r} ({exc})") from exc
    if computes_in_bf16 is None:
        computes_in_bf16 = precision == "bf16"
    if computes_in_bf16:
        routing = _keep_routing_f32(xml_path)
        logger.info("kept %d nodes of the MoE routers in f32", routing)
    if precision == "bf16":
        marked = _mark_weight_decompression(xml_path)
        logger.info("marked %d bf16 weights as decompressed where used", marked)
    if f32_inputs:
        kept = _keep_f32_from(xml_path, f32_inputs)
        logger.info("kept %d nodes computed from %s alone in f32", kept, ", ".join(f32_inputs))
    logger.info("wrote %s", xml_path)
    return xml_path

"""Collective ops' three faces: torch ops, ONNX nodes in domain numaov.collective, OpenVINO ops.

One tiny DP-attention MoE step (own rows -> every rank's rows -> expert shard -> own rows, and
the expert shards' partial sums exchanged all-to-all) is exported once per dtype and used
throughout: the ONNX nodes and their attributes, OpenVINO's
ONNX reading and IR round trip, shape inference, and two spawned ranks that run the IR and the
eager torch ops over shared memory against plain float64 math. Last, two spawned ranks where one
rank's OpenVINO op refuses its input: the other rank stops at once, not at the timeout.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np
import onnx
import openvino as ov
import pytest
import torch
from onnx import TensorProto, helper
from support.collectives_harness import run_ranks, shm_leftovers, unique_name

from numaov.custom_ops import (
    CollectiveOpError,
    OnnxRuntimeUnsupportedError,
    add_extension,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    check_onnxruntime_can_run,
    library_path,
    reduce_scatter_tensor,
)
from numaov.custom_ops.collective_ops import COLLECTIVE_DOMAIN

SEED = 20261129
DIM = 16
WORLD_SIZE = 2
# The group name is baked into the exported nodes; the shared-memory segments are kept apart
# from other runs by the per-run job id that run_on_ranks picks.
GROUP = "collective-ops-test"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
COLLECTIVE_TYPES = ("AllGatherIntoTensor", "AllToAll", "ReduceScatterTensor", "AllReduce")


class MoEStep(torch.nn.Module):
    """One DP-attention MoE step; `gate` stands for this rank's expert shard.

    The second output puts all_to_all where its result depends on every rank's input and on
    the block order: rank r receives block r of every rank's partial sums.
    """

    def __init__(self, dim: int, group: str, world_size: int) -> None:
        super().__init__()
        self.group = group
        self.world_size = world_size
        self.up = torch.nn.Linear(dim, dim)
        self.expert = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 1. own tokens: [n, d]
        h = self.up(x)
        # 2. every rank's tokens: [world_size * n, d]
        rows = all_gather_into_tensor(h, self.group, self.world_size)
        # 3. this rank's expert shard on all tokens: [world_size * n, d]
        partial = self.expert(rows) * gate
        # 4. own tokens' partial sums from every shard, in rank order: [world_size * n, d]
        exchanged = all_to_all(partial, self.group, self.world_size)
        # 5. own tokens summed over the shards: [n, d]
        mine = reduce_scatter_tensor(partial, self.group, self.world_size)
        # 6. summed over ranks, plus a residual: [n, d]
        return all_reduce(mine, self.group, self.world_size) + h, exchanged


def _module(dtype: torch.dtype) -> MoEStep:
    torch.manual_seed(SEED)  # same weights in every process
    return MoEStep(DIM, GROUP, WORLD_SIZE).to(dtype).eval()


def _inputs(rows: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-rank x [rows, DIM] and gate [DIM], rounded to bf16 so both dtypes see equal values."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, DIM, generator=gen).bfloat16().float().numpy()
          for _ in range(WORLD_SIZE)]
    gates = [(torch.rand(DIM, generator=gen) + 0.5).bfloat16().float().numpy()
             for _ in range(WORLD_SIZE)]
    return xs, gates


def _plain_math(xs: list[np.ndarray],
                gates: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """MoEStep of every rank in float64 numpy, no collectives: the ground truth."""
    m = _module(torch.float32)
    w1, b1 = m.up.weight.double().detach().numpy(), m.up.bias.double().detach().numpy()
    w2, b2 = m.expert.weight.double().detach().numpy(), m.expert.bias.double().detach().numpy()
    hs = [x.astype(np.float64) @ w1.T + b1 for x in xs]
    rows = np.concatenate(hs)
    partials = [(rows @ w2.T + b2) * g.astype(np.float64) for g in gates]
    n = xs[0].shape[0]
    mine = [sum(p[r * n:(r + 1) * n] for p in partials) for r in range(WORLD_SIZE)]
    exchanged = [np.concatenate([p[r * n:(r + 1) * n] for p in partials])
                 for r in range(WORLD_SIZE)]
    total = sum(mine)
    return [(total + h, e) for h, e in zip(hs, exchanged, strict=True)]


def _to_ov(array: np.ndarray, dtype: str) -> ov.Tensor:
    if dtype == "f32":
        return ov.Tensor(np.ascontiguousarray(array, dtype=np.float32))
    bits = torch.from_numpy(array).bfloat16().view(torch.int16).numpy().view(np.uint16)
    return ov.Tensor(np.ascontiguousarray(bits), list(array.shape), ov.Type.bf16)


def _from_ov(tensor: ov.Tensor) -> np.ndarray:
    if tensor.get_element_type() == ov.Type.bf16:
        bits = np.ascontiguousarray(tensor.data).view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
    return np.array(tensor.data, dtype=np.float32)


def _core() -> ov.Core:
    core = ov.Core()
    add_extension(core)
    return core


def _compile(core: ov.Core, xml: Path, dtype: str, config: dict | None = None) -> ov.CompiledModel:
    config = dict(config or {})
    # f32 IR runs in f32 (this machine would otherwise pick bf16); a bf16 IR runs in bf16.
    config["INFERENCE_PRECISION_HINT"] = "f32" if dtype == "f32" else "bf16"
    return core.compile_model(str(xml), "CPU", config)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """dtype -> (model.onnx, model.xml) of MoEStep exported with a dynamic row count."""
    out = tmp_path_factory.mktemp("collective_ops")
    core = _core()
    paths = {}
    for name, dtype in DTYPES.items():
        xs, gates = _inputs(rows=3, seed=SEED)
        args = (torch.from_numpy(xs[0]).to(dtype), torch.from_numpy(gates[0]).to(dtype))
        onnx_path, xml_path = out / f"moe_step_{name}.onnx", out / f"moe_step_{name}.xml"
        program = torch.onnx.export(
            _module(dtype), args, dynamo=True, verbose=False,
            dynamic_shapes=({0: torch.export.Dim("rows")}, None),
        )
        program.save(str(onnx_path))
        ov.save_model(core.read_model(str(onnx_path)), str(xml_path), compress_to_fp16=False)
        paths[name] = (onnx_path, xml_path)
    return paths


# ---------------------------------------------------------------------------------------------
# (a) single process: export, conversion, IR round trip, shapes, refusals
# ---------------------------------------------------------------------------------------------


def test_export_writes_collective_nodes_with_attributes(exported) -> None:
    model = onnx.load(str(exported["f32"][0]))
    nodes = [n for n in model.graph.node if n.domain == COLLECTIVE_DOMAIN]
    assert [n.op_type for n in nodes] == list(COLLECTIVE_TYPES)
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"group": GROUP.encode(), "world_size": WORLD_SIZE}
    assert {(o.domain, o.version) for o in model.opset_import} >= {(COLLECTIVE_DOMAIN, 1)}
    # The row count stays symbolic through the gather (2*rows) and the scatter (rows).
    out_dims = model.graph.output[0].type.tensor_type.shape.dim
    assert out_dims[0].dim_param and out_dims[1].dim_value == DIM


def test_the_exporters_translation_table_writes_the_same_nodes(exported, tmp_path: Path) -> None:
    # numaov's exporter captures with torch.export before torch.onnx.export sees the program,
    # so its collectives reach ONNX through collective_translation_table, not _onnx_node.
    from numaov.exporter.onnx_export import export_onnx

    xs, gates = _inputs(rows=3, seed=SEED)
    path = tmp_path / "moe_step.onnx"
    export_onnx(_module(torch.float32), (torch.from_numpy(xs[0]), torch.from_numpy(gates[0])),
                None, ({0: torch.export.Dim("rows")}, None), path)

    def collective_nodes(onnx_path: Path) -> list:
        model = onnx.load(str(onnx_path), load_external_data=False)
        return [(n.op_type, {a.name: helper.get_attribute_value(a) for a in n.attribute})
                for n in model.graph.node if n.domain == COLLECTIVE_DOMAIN]

    assert collective_nodes(path) == collective_nodes(exported["f32"][0])
    assert [op for op, _ in collective_nodes(path)] == list(COLLECTIVE_TYPES)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_openvino_reads_onnx_and_ir_round_trips(exported, dtype: str) -> None:
    onnx_path, xml_path = exported[dtype]
    core = _core()
    for model in (core.read_model(str(onnx_path)), core.read_model(str(xml_path)),
                  ov.convert_model(str(onnx_path), extension=str(library_path()))):
        ops = [op for op in model.get_ordered_ops() if op.get_type_info().version_id == "numaov"]
        assert [op.get_type_name() for op in ops] == list(COLLECTIVE_TYPES)
        for op in ops:
            assert op.get_attributes() == {"group": GROUP, "world_size": WORLD_SIZE}
            assert op.get_output_element_type(0) == (ov.Type.f32 if dtype == "f32"
                                                     else ov.Type.bf16)
        shapes = [str(op.get_output_partial_shape(0)) for op in ops]
        assert shapes == [f"[?,{DIM}]"] * 4
    assert xml_path.with_suffix(".bin").is_file()
    assert 'type="AllGatherIntoTensor" version="numaov"' in xml_path.read_text()


def test_shapes_follow_world_size_after_reshape(exported) -> None:
    model = _core().read_model(str(exported["f32"][1]))
    model.reshape({model.inputs[0]: ov.PartialShape([5, DIM])})
    shapes = {op.get_type_name(): op.get_output_partial_shape(0)
              for op in model.get_ordered_ops() if op.get_type_info().version_id == "numaov"}
    assert shapes == {"AllGatherIntoTensor": ov.PartialShape([10, DIM]),
                      "AllToAll": ov.PartialShape([10, DIM]),
                      "ReduceScatterTensor": ov.PartialShape([5, DIM]),
                      "AllReduce": ov.PartialShape([5, DIM])}
    # An interval scales too: 2..5 rows per rank gather to 4..10.
    model.reshape({model.inputs[0]: ov.PartialShape("[2..5,16]")})
    gathered = next(op for op in model.get_ordered_ops()
                    if op.get_type_name() == "AllGatherIntoTensor")
    assert gathered.get_output_partial_shape(0) == ov.PartialShape("[4..10,16]")


def _single_node_onnx(path: Path, op_type: str, dims: list, world_size: int,
                      group: str = GROUP) -> Path:
    """A model of one numaov.collective node, written without torch."""
    node = helper.make_node(op_type, ["x"], ["y"], domain=COLLECTIVE_DOMAIN, group=group,
                            world_size=world_size)
    graph = helper.make_graph(
        [node], "one_collective",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid(COLLECTIVE_DOMAIN, 1)])
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(("op_type", "dims", "expected"), [
    ("AllReduce", [4, 3], "[4,3]"),
    ("AllGatherIntoTensor", [4, 3], "[12,3]"),
    ("ReduceScatterTensor", [6, 3], "[2,3]"),
    ("AllToAll", [6, 3], "[6,3]"),
    ("AllGatherIntoTensor", ["n", 3], "[?,3]"),
    ("ReduceScatterTensor", ["n", 3], "[?,3]"),
    ("AllToAll", ["n", 3], "[?,3]"),
    ("AllReduce", [], "[]"),
])
def test_shape_inference_of_one_node(tmp_path: Path, op_type: str, dims: list,
                                     expected: str) -> None:
    model = _core().read_model(str(_single_node_onnx(tmp_path / "m.onnx", op_type, dims, 3)))
    assert str(model.outputs[0].get_partial_shape()) == expected


@pytest.mark.parametrize(("op_type", "dims", "message"), [
    ("ReduceScatterTensor", [4, 3], "input dim 0 is 4; expected a multiple of world_size 3"),
    ("AllToAll", [4, 3], "input dim 0 is 4; expected a multiple of world_size 3"),
    ("AllGatherIntoTensor", [], "input is a scalar"),
    ("AllToAll", [], "input is a scalar"),
])
def test_shape_errors_name_the_problem(tmp_path: Path, op_type: str, dims: list,
                                       message: str) -> None:
    path = _single_node_onnx(tmp_path / "m.onnx", op_type, dims, 3)
    with pytest.raises(Exception, match=message):
        _core().read_model(str(path))


def test_fake_kernels_keep_the_row_count_symbolic() -> None:
    xs, gates = _inputs(rows=3, seed=SEED)
    program = torch.export.export(
        _module(torch.float32), (torch.from_numpy(xs[0]), torch.from_numpy(gates[0])),
        dynamic_shapes=({0: torch.export.Dim("rows")}, None),
    )
    shapes = {str(node.target): node.meta["val"].shape for node in program.graph.nodes
              if str(node.target).startswith("numaov.")}
    rows = program.graph_signature.user_inputs[0]
    rows = next(n for n in program.graph.nodes if n.name == rows).meta["val"].shape[0]
    assert shapes == {"numaov.all_gather_into_tensor.default": (2 * rows, DIM),
                      "numaov.all_to_all.default": (2 * rows, DIM),
                      "numaov.reduce_scatter_tensor.default": (rows, DIM),
                      "numaov.all_reduce.default": (rows, DIM)}


@pytest.mark.parametrize(("call", "message"), [
    (lambda: all_reduce(torch.ones(4, dtype=torch.int64), GROUP, 2), "dtype is torch.int64"),
    (lambda: reduce_scatter_tensor(torch.ones(5, 2), GROUP, 2),
     "dim 0 is 5; expected a multiple of world_size 2"),
    (lambda: all_to_all(torch.ones(5, 2), GROUP, 2),
     "all_to_all: dim 0 is 5; expected a multiple of world_size 2"),
    (lambda: all_to_all(torch.ones(()), GROUP, 2), "tensor is a scalar"),
    (lambda: all_to_all(torch.ones(4, dtype=torch.int32), GROUP, 2), "dtype is torch.int32"),
    (lambda: all_gather_into_tensor(torch.ones(()), GROUP, 2), "tensor is a scalar"),
    (lambda: all_reduce(torch.ones(2), "", 2), "expected a non-empty group name"),
    (lambda: all_reduce(torch.ones(2), GROUP, 0), "world_size is 0"),
])
def test_bad_arguments_raise_before_any_communication(call, message: str) -> None:
    with pytest.raises(CollectiveOpError, match=message):
        call()


def test_onnxruntime_refusal_is_clear(exported, tmp_path: Path) -> None:
    onnx_path = exported["f32"][0]
    with pytest.raises(OnnxRuntimeUnsupportedError,
                       match=r"ONNX Runtime cannot run numaov\.collective nodes "
                             r"\(AllGatherIntoTensor, AllReduce, AllToAll, ReduceScatterTensor\) "
                             r"in .*"
                             r"use OpenVINO with the numaov extension"):
        check_onnxruntime_can_run(onnx_path)
    with pytest.raises(OnnxRuntimeUnsupportedError, match="AllReduce"):
        check_onnxruntime_can_run(onnx.load(str(onnx_path)))
    # A model without collective nodes passes, and ONNX Runtime indeed runs it.
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 20)])
    check_onnxruntime_can_run(plain)


# ---------------------------------------------------------------------------------------------
# Registry lookups in one process: a world-size-1 group runs the ops; mismatches are named.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def solo_group():
    """A registered world-size-1 shared-memory group (name -> communicator)."""
    from numaov.distributed.communicator import ShmCommunicator, destroy_communicator

    made: list[str] = []

    def make(group: str):
        # Creating it registers it, in Python and in the C++ registry OpenVINO's ops read.
        comm = ShmCommunicator(group, 0, 1, job_id=f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                               timeout_s=20)
        made.append(group)
        return comm

    yield make
    for group in made:
        destroy_communicator(group)


@pytest.mark.parametrize("op_type", COLLECTIVE_TYPES)
def test_world_size_one_runs_in_openvino_and_eager(tmp_path: Path, solo_group,
                                                   op_type: str) -> None:
    group = f"solo-{uuid.uuid4().hex[:8]}"
    solo_group(group)
    x = np.arange(12, dtype=np.float32).reshape(4, 3) - 5.5
    path = _single_node_onnx(tmp_path / "m.onnx", op_type, ["n", 3], 1, group=group)
    compiled = _core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    # With one rank every collective is the identity: exact.
    np.testing.assert_array_equal(compiled(x)[0], x)
    eager = {"AllReduce": all_reduce, "AllGatherIntoTensor": all_gather_into_tensor,
             "ReduceScatterTensor": reduce_scatter_tensor, "AllToAll": all_to_all}[op_type]
    np.testing.assert_array_equal(eager(torch.from_numpy(x), group, 1).numpy(), x)


def test_world_size_mismatch_and_unknown_group_are_named(exported, solo_group) -> None:
    xs, gates = _inputs(rows=2, seed=SEED)
    compiled = _compile(_core(), exported["f32"][1], "f32")
    with pytest.raises(RuntimeError, match=f"'{GROUP}' not found|{GROUP}.*not found"):
        compiled([xs[0], gates[0]])
    solo_group(GROUP)  # registered with 1 rank; the model was exported for 2
    with pytest.raises(RuntimeError, match=f"exported for world_size 2 but communicator group "
                                           f"'{GROUP}' has 1 ranks"):
        compiled([xs[0], gates[0]])
    with pytest.raises(CollectiveOpError, match="called with world_size 2 but communicator"):
        _module(torch.float32)(torch.from_numpy(xs[0]), torch.from_numpy(gates[0]))


def _gloo_named_group(rank: int, world: int, args: dict) -> dict[str, str]:
    """A GlooCommunicator under a group name, seen through every lookup of that name."""
    import torch.distributed as dist

    from numaov.distributed.communicator import (
        CollectiveError,
        GlooCommunicator,
        ShmCommunicator,
        destroy_communicator,
        find_communicator,
    )

    dist.init_process_group("gloo", init_method=f"file://{args['store']}", rank=rank,
                            world_size=world)
    gloo = GlooCommunicator(args["group"], dist.group.WORLD)
    seen = {"python": type(find_communicator(args["group"])).__name__}
    # The eager op runs on it: the same registry entry.
    seen["eager"] = str(all_reduce(torch.ones(2), args["group"], 1).tolist())
    compiled = _core().compile_model(args["model"], "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    try:
        compiled(np.ones((2, 3), np.float32))
    except RuntimeError as exc:
        seen["openvino"] = str(exc)
    try:
        ShmCommunicator(args["group"], 0, 1, job_id=args["group"], timeout_s=10)
    except CollectiveError as exc:
        seen["shm"] = str(exc)
    destroy_communicator(args["group"])
    try:
        gloo.barrier()
    except CollectiveError as exc:
        seen["after"] = str(exc)
    dist.destroy_process_group()
    return seen


@pytest.mark.slow
def test_a_gloo_group_name_is_one_entry_that_openvino_refuses_by_name(tmp_path: Path) -> None:
    group = unique_name("gloo-named")
    model = _single_node_onnx(tmp_path / "m.onnx", "AllReduce", ["n", 3], 1, group=group)
    seen = run_ranks(1, _gloo_named_group,
                     {"store": str(tmp_path / "store"), "group": group, "model": str(model)})[0]
    assert seen["python"] == "GlooCommunicator" and seen["eager"] == "[1.0, 1.0]", seen
    assert ("AllReduce 'y'" in seen["openvino"] and f"collective group '{group}' is a "
            "GlooCommunicator" in seen["openvino"] and "cannot run" in seen["openvino"]), seen
    assert "already has a communicator in this process (a GlooCommunicator)" in seen["shm"], seen
    assert "destroyed" in seen["after"], seen


# ---------------------------------------------------------------------------------------------
# (b) two spawned ranks over shared memory: OpenVINO IR == eager torch ops == plain math
# ---------------------------------------------------------------------------------------------


def _run_rank(context, job: dict) -> dict:
    """In each rank: the eager module and the compiled IR on this rank's inputs, per dtype."""
    torch.set_num_threads(1)
    core = _core()
    results = {}
    for dtype, xml in job["xml"].items():
        compiled = _compile(core, Path(xml), dtype, context.openvino_config())
        module = _module(DTYPES[dtype])
        for case, (x, gate) in enumerate(job["inputs"]):
            with torch.no_grad():
                eager = module(torch.from_numpy(x).to(DTYPES[dtype]),
                               torch.from_numpy(gate).to(DTYPES[dtype]))
            request = compiled.create_infer_request()
            request.infer([_to_ov(x, dtype), _to_ov(gate, dtype)])
            for output in range(2):  # the step's result, the exchanged partial sums
                results[(dtype, case, output)] = (eager[output].float().numpy(),
                                                  _from_ov(request.get_output_tensor(output)))
    return results


@pytest.mark.slow
def test_two_ranks_openvino_matches_eager_and_plain_math(exported, two_cpus) -> None:
    from numaov.runtime.placement.binding import BindingPlan
    from numaov.runtime.placement.topology import read_topology
    from numaov.runtime.placement.workers import run_on_ranks

    seed = SEED + 1
    print(f"seed={seed}")
    # Two row counts through the same compiled model: dynamic dim 0 at run time.
    cases = [_inputs(rows=4, seed=seed), _inputs(rows=1, seed=seed + 1)]
    xml = {dtype: str(paths[1]) for dtype, paths in exported.items()}
    jobs = [{"xml": xml, "inputs": [(xs[r], gates[r]) for xs, gates in cases]}
            for r in range(WORLD_SIZE)]
    plan = BindingPlan.from_bind_string(f"{two_cpus[0]}|{two_cpus[1]}", read_topology())
    per_rank = run_on_ranks(plan, _run_rank, jobs, group=GROUP, timeout_s=150)

    # Outputs are O(1) (|out| < 5 for these weights and inputs). f32: eager torch and OpenVINO
    # differ from float64 math only by fp32 rounding and matmul summation order (< 1e-6 seen),
    # so 1e-5 leaves a 10x margin while any wrong row or missing rank is off by O(1).
    # bf16: every op rounds to 8 significant bits (ulp 2^-5 = 0.031 at |x| in [4, 8)) and five
    # ops round in a row: up to 0.027 absolute seen against float64; atol 0.05 + rtol 2^-6
    # (two bf16 ulps) bounds that. OpenVINO and eager may round at different points, so they
    # are held to the same bound.
    # The exchanged partial sums (all_to_all's output) went through fewer ops: the same bounds.
    tolerance = {"f32": {"rtol": 1e-5, "atol": 1e-5}, "bf16": {"rtol": 2.0**-6, "atol": 5e-2}}
    for case, (xs, gates) in enumerate(cases):
        truth = _plain_math(xs, gates)
        rows = xs[0].shape[0]
        for dtype, tol in tolerance.items():
            for rank in range(WORLD_SIZE):
                for output, shape in enumerate([(rows, DIM), (WORLD_SIZE * rows, DIM)]):
                    eager, openvino = per_rank[rank][(dtype, case, output)]
                    want = truth[rank][output]
                    where = f"{dtype} case {case} rank {rank} output {output}"
                    assert openvino.shape == want.shape == shape, where
                    np.testing.assert_allclose(openvino, want, **tol, err_msg=f"{where} OV")
                    np.testing.assert_allclose(eager, want, **tol, err_msg=f"{where} eager")
                    np.testing.assert_allclose(openvino, eager, **tol,
                                               err_msg=f"{where} OV/eager")


# ---------------------------------------------------------------------------------------------
# (c) an OpenVINO op error on one rank fails the peers well before the timeout
# ---------------------------------------------------------------------------------------------

# The communicators' timeout in these scenarios: the peers must stop far sooner than this.
FAIL_TIMEOUT_S = 30.0
# The faulty rank starts this late, so its peer is already waiting inside the collective.
LATE_S = 0.5
# Each scenario: (op, rows fed by rank 0 and rank 1, world_size each rank's model was exported
# for, whether rank 1's model names a group this process does not have). Rank 1 is the faulty one.
FAILURES = {
    "shape": ("ReduceScatterTensor", (4, 5), (2, 2), False),   # 5 rows do not split over 2 ranks
    "a2a-shape": ("AllToAll", (4, 5), (2, 2), False),          # nor do they for an all-to-all
    "world-size": ("AllReduce", (4, 4), (2, 3), False),        # rank 1's model is for 3 ranks
    "unknown-group": ("AllGatherIntoTensor", (4, 4), (2, 2), True),
}


def _failing_rank(rank: int, world: int, args: dict) -> dict[str, tuple[str, float]]:
    """Per scenario: this rank's error text and how long its inference took to raise."""
    from numaov.distributed.communicator import ShmCommunicator

    core = _core()
    control = ShmCommunicator(args["prefix"] + "-control", rank, world, job_id=args["prefix"],
                              timeout_s=120)
    outcomes = {}
    for name, paths in args["models"].items():
        comm = ShmCommunicator(f"{args['prefix']}-{name}", rank, world, job_id=args["prefix"],
                               timeout_s=FAIL_TIMEOUT_S)
        compiled = core.compile_model(paths[rank], "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        x = np.ones((FAILURES[name][1][rank], 3), np.float32)
        control.barrier()  # compiled on both ranks: only the inference is timed
        if rank == 1:
            time.sleep(LATE_S)
        start = time.monotonic()
        try:
            compiled(x)
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        elapsed = time.monotonic() - start
        # As a worker does on an error: its communicators close (a peer still waiting sees it).
        comm.close()
        outcomes[name] = (error, elapsed)
    control.close()
    return outcomes


@pytest.mark.slow
def test_an_openvino_op_error_on_one_rank_fails_the_peers_at_once(tmp_path: Path) -> None:
    prefix = unique_name("ov-fail")
    models = {}
    for name, (op_type, _, world_sizes, unknown) in FAILURES.items():
        models[name] = [
            str(_single_node_onnx(tmp_path / f"{name}-{rank}.onnx", op_type, ["n", 3],
                                  world_sizes[rank],
                                  group=f"{prefix}-{'nowhere' if unknown and rank else name}"))
            for rank in range(2)
        ]
    results = run_ranks(2, _failing_rank, {"prefix": prefix, "models": models})
    for name in FAILURES:
        print(f"{name}: rank 0 raised after {results[0][name][1]:.3f} s, rank 1 after "
              f"{results[1][name][1]:.3f} s (timeout {FAIL_TIMEOUT_S:.0f} s)")
    faulty = {name: results[1][name][0] for name in FAILURES}
    peer = {name: results[0][name][0] for name in FAILURES}

    # The faulty rank names its op and what was wrong, at once.
    assert "ReduceScatterTensor 'y': input dim 0 is 5; expected a multiple of world_size 2" in (
        faulty["shape"]), faulty["shape"]
    assert "AllToAll 'y': input dim 0 is 5; expected a multiple of world_size 2" in (
        faulty["a2a-shape"]), faulty["a2a-shape"]
    assert "exported for world_size 3 but communicator group" in faulty["world-size"], faulty
    assert "AllGatherIntoTensor 'y'" in faulty["unknown-group"], faulty["unknown-group"]
    assert f"collective group '{prefix}-nowhere' not found" in faulty["unknown-group"]
    assert f"'{prefix}-unknown-group'" in faulty["unknown-group"]  # the groups it does have
    for name in FAILURES:
        assert results[1][name][1] < 2.0, (name, results[1][name])
    # A known group is failed before the error is thrown: the waiting peer quotes it.
    for name in ("shape", "a2a-shape"):
        assert "group failed" in peer[name] and "input dim 0 is 5" in peer[name], peer
    assert "group failed" in peer["world-size"] and "world_size 3" in peer["world-size"], peer
    # An unknown group has nothing to fail; the peer stops when the faulty rank closes its own.
    assert "rank 1 closed its communicator" in peer["unknown-group"], peer["unknown-group"]
    # Well under the timeout: the peer waited for the late start (LATE_S), then stopped.
    for name in FAILURES:
        assert "timed out" not in peer[name], (name, peer[name])
        assert results[0][name][1] < LATE_S + 3.0 < FAIL_TIMEOUT_S / 5, (name, results[0][name])
    assert shm_leftovers(prefix) == []

"""numaov export lm --weights int8 | int4: the rank's expert store holds the routed experts as
integer stacks with their scales, which the MoeExperts op reads; the other matmuls are
NNCF-compressed; the
manifest records the format; the export's parity (against the f32 PyTorch model, within the
format's tolerance) passed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from numaov.custom_ops import add_extension, compile_ir
from numaov.custom_ops.expert_store import STORE_NAME, open_store
from numaov.exporter.lm_export import export_lm
from numaov.exporter.weight_formats import WEIGHT_TOLERANCES, WeightFormatError, parity_tolerance
from numaov.models.builtin.deepseek_tiny import build_tiny_deepseek

pytestmark = pytest.mark.slow  # exports the tiny DeepSeek


STACK_DTYPES = {"i8": torch.int8, "u8": torch.uint8}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_deepseek(tmp_path_factory.mktemp("tiny") / "checkpoint", seed=0)


@pytest.mark.parametrize(("weights", "stack_type", "group"), [("int8", "i8", None),
                                                              ("int4", "u8", 32)])
def test_quantized_export_stores_the_experts_for_the_moe_op(
        checkpoint: Path, tmp_path: Path, weights: str, stack_type: str, group: int | None
) -> None:
    import openvino as ov

    out = tmp_path / weights
    manifest = export_lm(checkpoint, out, weights=weights)
    data = json.loads((out / "manifest.json").read_text())
    assert (data["weights"], data["weights_group_size"]) == (weights, group)
    assert data["precision"] == "f32"
    logits = [f for f in data["parity"] if f["output"] == "logits"]
    assert logits and all(f["passed"] and f["tolerance"] == WEIGHT_TOLERANCES[weights]
                          for f in logits)
    assert "numaov.moe" in " ".join(data["notes"])
    core = ov.Core()
    add_extension(core)
    model = core.read_model(str(out / "rank_0/model.xml"))
    moe = [n for n in model.get_ordered_ops() if n.get_type_name() == "MoeExperts"]
    assert len(moe) == 2
    # the nodes name the rank's store, which holds the quantized stacks and their scales
    store = open_store(out / "rank_0" / STORE_NAME)
    for node in moe:
        assert node.get_input_size() == 3
        layer = store.layers[node.get_attributes()["layer"]]
        assert layer.plan.weight_format == weights
        assert layer.gate_up.dtype == STACK_DTYPES[stack_type] == layer.down.dtype
        assert layer.gate_up_scale.dtype == layer.down_scale.dtype == torch.float32
        hidden = layer.plan.hidden
        assert layer.gate_up_scale.shape[2] == (hidden // group if group else 1)
    # NNCF's weight-compressed matmuls: integer constants behind a Convert
    compressed = [n for n in model.get_ordered_ops() if n.get_type_name() == "Constant"
                  and n.get_element_type().get_type_name() in ("i8", "i4")]
    assert len(compressed) >= 10
    assert manifest.weights == weights
    # the reference sample runs in the compiled graph within the format's tolerance
    sample = np.load(out / "reference_sample.npz")
    feeds = {k[len("input."):]: sample[k] for k in sample.files if k.startswith("input.")}
    got = compile_ir(out / "rank_0/model.xml", "f32").runner()(feeds)[0]
    ref = sample["output.logits"]
    assert np.abs(got - ref).max() / np.abs(ref).max() < WEIGHT_TOLERANCES[weights]


def test_int4_needs_rows_divisible_by_32(checkpoint: Path, tmp_path: Path) -> None:
    # the tiny model's expert shard at dp=2 is 16 values wide
    with pytest.raises(WeightFormatError, match=r"int4 expert weights need rows whose lengths "
                       r"\[64, 16\] are multiples of one of the group sizes") as info:
        export_lm(checkpoint, tmp_path / "out", dp=2, weights="int4")
    assert info.value.parameter == "weights"
    assert not (tmp_path / "out").exists()


def test_bf16_export_matches_with_the_experts_on_amx_tiles_and_on_avx512(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--weights bf16: the export's own parity ran with every routed expert on AMX tiles
    (NUMAOV_MOE_AMX=always) and passed at the bf16 tolerance; the compiled graph on the
    AVX512-BF16 path passes it too."""
    from numaov.custom_ops.moe_ops import bf16_kernel

    monkeypatch.setenv("NUMAOV_MOE_AMX", "always")
    kernel = bf16_kernel()
    if kernel["kernel"] != "amx":
        pytest.skip(f"needs AMX tiles: {kernel['reason']}")
    out = tmp_path / "bf16"
    export_lm(checkpoint, out, weights="bf16")
    data = json.loads((out / "manifest.json").read_text())
    assert data["weights"] == "bf16"
    tolerance = parity_tolerance("bf16", data["precision"])  # bf16 inference's, 0.1
    logits = [f for f in data["parity"] if f["output"] == "logits"]
    assert logits and all(f["passed"] and f["tolerance"] == tolerance for f in logits)
    sample = np.load(out / "reference_sample.npz")
    feeds = {k[len("input."):]: sample[k] for k in sample.files if k.startswith("input.")}
    ref = sample["output.logits"]
    run = compile_ir(out / "rank_0/model.xml", data["precision"]).runner()
    got = {}
    for setting in ("always", "off"):
        monkeypatch.setenv("NUMAOV_MOE_AMX", setting)
        got[setting] = run(feeds)[0]
        assert np.abs(got[setting] - ref).max() / np.abs(ref).max() < tolerance, setting
    assert not np.array_equal(got["always"], got["off"])  # the two kernels both ran

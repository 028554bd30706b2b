"""The Wan transformer's export at size: memory that follows the weights (bf16 held as stored,
no f32 copy), and bf16 parity judged block by block, so depth neither fails a correct export
nor hides a wrong block."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from numaov.exporter import wan_export
from numaov.exporter.parity import STAGE_TOLERANCE, ParityError
from numaov.models.builtin.wan_tiny import TINY_WAN_CONFIG, save_wan_checkpoint
from numaov.models.wan import block_states
from numaov.models.wan.transformer import WanTransformer

pytestmark = pytest.mark.slow  # bf16 exports in fresh processes

PROBE = Path(__file__).resolve().parents[1] / "support" / "export_memory_probe.py"
# Wide enough that the weights outweigh the allocator's and the libraries' noise: each block
# is 9.4 M parameters (19 MB in bf16), so the 6 blocks the deeper export adds are 113 MB.
WIDE = replace(TINY_WAN_CONFIG, num_attention_heads=12, attention_head_dim=64, text_dim=512,
               freq_dim=256, ffn_dim=3072, qk_norm="rms_norm_across_heads")
SHALLOW, DEEP = 2, 8
# The export's peak may grow by the added weights (torch's bf16 model, then OpenVINO's compiled
# copy: 1.2-1.3x of them measured, each stage released before the next) plus the allocator's
# slack; it grew by ~6x them when the model was loaded in f32 and ONNX Runtime folded every
# bf16 weight's Cast into an f32 copy.
MAX_GROWTH_PER_WEIGHT_BYTE = 2.0
WRONG = 1.25  # the factor the wrong block's weights are off by


def _bf16_checkpoint(directory: Path, layers: int, config=WIDE) -> tuple[Path, int]:
    """A bf16 checkpoint of ``layers`` blocks (diffusers layout) and its weights' bytes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layers)
        model = WanTransformer(replace(config, num_layers=layers)).to(torch.bfloat16)
    save_wan_checkpoint(model, directory)
    return directory, sum(p.numel() * p.element_size() for p in model.parameters())


def _export_peak(checkpoint: Path, out: Path) -> float:
    proc = subprocess.run([sys.executable, str(PROBE), str(checkpoint), str(out), "bf16"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"] * 2**20


def test_export_memory_grows_with_the_weights_and_parity_is_judged_per_block(tmp_path) -> None:
    shallow, shallow_bytes = _bf16_checkpoint(tmp_path / "shallow", SHALLOW)
    deep, deep_bytes = _bf16_checkpoint(tmp_path / "deep", DEEP)
    peaks = {n: _export_peak(c, tmp_path / f"out{n}") for n, c in ((SHALLOW, shallow), (DEEP, deep))}
    added = deep_bytes - shallow_bytes
    growth = peaks[DEEP] - peaks[SHALLOW]
    print(f"peaks {peaks[SHALLOW] / 2**20:.0f} / {peaks[DEEP] / 2**20:.0f} MiB: grew "
          f"{growth / 2**20:.0f} MiB for {added / 2**20:.0f} MiB of added bf16 weights")
    assert growth <= MAX_GROWTH_PER_WEIGHT_BYTE * added

    out = tmp_path / f"out{DEEP}"
    # the IR holds the bf16 weights once (no f32 copy, nothing twice), and keeps the timestep's
    # sinusoids f32 (without it every block was 2-4.5% off: over STAGE_TOLERANCE)
    assert (out / "model.bin").stat().st_size <= 1.02 * deep_bytes
    assert '<attribute name="precise" version="0"' in (out / "model.xml").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    staged = [f for f in manifest["parity"] if f["criterion"] == "rms"]
    assert sorted({f["output"] for f in staged}) == sorted([*block_states(DEEP), "sample"])
    assert all(f["passed"] and f["judged"] and f["backend"] == "openvino" for f in staged)
    assert all(f["tolerance"] == STAGE_TOLERANCE.max_rel_error for f in staged)
    whole = [f for f in manifest["parity"] if f["backend"] == "openvino" and f["criterion"] == "max"]
    assert whole and not any(f["judged"] for f in whole)  # kept for the record
    assert all(f["judged"] and f["passed"] for f in manifest["parity"]
               if f["backend"] == "onnxruntime")

    # Loaded: once a step has run (the plugin packed the weights it read from the mapped IR),
    # the IR's pages are let go and the next step does not read them again.
    proc = subprocess.run([sys.executable, str(PROBE), "load", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"IR pages resident: {loaded}")
    assert loaded["same"]
    assert loaded["after_first_mib"] <= 0.05 * deep_bytes / 2**20
    assert loaded["after_second_mib"] <= 0.05 * deep_bytes / 2**20


def test_a_block_whose_weights_are_off_is_refused(tmp_path, monkeypatch) -> None:
    """The graph gets block 2 of 4 with every weight 25% too large; the reference has it right.
    Only that block's stage is off (by ~4.5% on this narrow model, whose blocks change their
    input state little) and the export is refused. (ONNX
    Runtime's f32 check of the whole sample refuses it first; it is left out here to show
    that OpenVINO's bf16 check alone, block by block, does.)"""
    checkpoint, _ = _bf16_checkpoint(tmp_path / "checkpoint", 4,
                                     replace(TINY_WAN_CONFIG, num_attention_heads=4,
                                             attention_head_dim=32, ffn_dim=512))
    export_onnx = wan_export.export_onnx

    def export_a_wrong_block(model, *args, **kwargs):
        weights = [m.parametrizations.weight.original for m in model.blocks[2].modules()
                   if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for weight in weights:
                weight.mul_(WRONG)
            try:
                return export_onnx(model, *args, **kwargs)
            finally:
                for weight in weights:
                    weight.div_(WRONG)

    monkeypatch.setattr(wan_export, "export_onnx", export_a_wrong_block)
    check_parity = wan_export.check_parity
    monkeypatch.setattr(wan_export, "check_parity",
                        lambda sets, ref, names, _onnx, *args, **kwargs:
                        check_parity(sets, ref, names, None, *args, **kwargs))
    out = tmp_path / "out"
    with pytest.raises(ParityError, match="block by block") as refused:
        wan_export.export_wan(checkpoint, out, precision="bf16")
    failed = {f.output for f in refused.value.figures if f.judged and not f.passed}
    assert failed == {"block_2"}, failed
    assert not out.exists()


def test_a_one_block_transformer_exports_its_block_states(tmp_path) -> None:
    """One block's output is both the first and the last block state: the graph still returns
    each under its name (the step cache's parts and the per-block parity need both)."""
    checkpoint, _ = _bf16_checkpoint(tmp_path / "checkpoint", 1, TINY_WAN_CONFIG)
    manifest = wan_export.export_wan(checkpoint, tmp_path / "out", precision="bf16")
    assert [o.name for o in manifest.outputs] == ["sample", "embedded", "first_block",
                                                  "last_block"]
    assert "first_block" in {f["output"] for f in manifest.parity if f.get("criterion") == "rms"}


def test_the_bf16_text_encoder_holds_its_table_in_bf16_and_gathers_first(tmp_path) -> None:
    """UMT5 exported at bf16 holds its weights in bf16 (the IR about their bytes) and gathers
    the embedding's rows before widening them (a Cast of the whole table ran in ONNX Runtime
    at every call: UMT5-XXL's in f32 is 4.2 GB); parity passes on both backends."""
    import onnx

    from numaov.exporter.reuse import ComponentReuse
    from numaov.exporter.wan_pipeline_export import _export_text_encoder
    from numaov.models.builtin.tiny_text_encoder import tiny_umt5_encoder

    torch.manual_seed(0)
    encoder = tiny_umt5_encoder(8192, 64).to(torch.bfloat16)
    encoder.save_pretrained(tmp_path / "text_encoder")
    weights = sum(p.numel() * p.element_size() for p in encoder.parameters())
    manifest = _export_text_encoder(tmp_path / "text_encoder", tmp_path / "out", "bf16",
                                    "decomposed", print, ComponentReuse(None, print))
    assert {f["backend"] for f in manifest.parity if f["passed"]} == {"onnxruntime", "openvino"}
    graph = onnx.load(tmp_path / "out" / "text_encoder" / "model.onnx",
                      load_external_data=False).graph
    bf16 = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.BFLOAT16}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in bf16]
    assert gathers, "the embedding table is not gathered as held"
    ir = (tmp_path / "out" / "text_encoder" / "model.bin").stat().st_size
    assert ir < 1.2 * weights, (ir, weights)

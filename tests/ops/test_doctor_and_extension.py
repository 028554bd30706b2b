"""The native library builds and loads into OpenVINO; `numaov doctor` reports."""

from __future__ import annotations

import json
import subprocess
import sys

import openvino as ov

from numaov.custom_ops import add_extension, library_path
from numaov.runtime.doctor import REPORT_KEYS
from numaov.runtime.placement.topology import read_topology


def test_extension_library_loads_into_openvino() -> None:
    path = library_path()
    assert path.is_file() and path.name == "libnumaov.so"
    add_extension(ov.Core())


def _doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numaov.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_doctor_json_has_documented_keys() -> None:
    result = _doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert tuple(report) == REPORT_KEYS
    topo = read_topology()
    assert len(report["topology"]["numa_nodes"]) == len(topo.nodes)
    assert report["topology"]["physical_cores"] == len(topo.physical_cores)
    assert report["isa"]["flags"]["avx512_bf16"] == topo.isa.avx512_bf16
    assert report["isa"]["flags"]["amx_usable"] == topo.isa.amx_usable
    assert report["extension"]["loads"] is True and report["extension"]["error"] is None
    attention = report["extension"]["attention"]
    assert attention["setting"] == "auto"
    assert attention["kernel"] == ("numaov" if topo.isa.amx_usable else "openvino")
    moe = report["extension"]["moe"]
    if topo.isa.amx_usable:
        assert (moe["bf16_kernel"], moe["amx_min_rows"]) == ("amx", 2), moe
    else:
        assert moe["bf16_kernel"] in ("avx512_bf16", None) and moe["reason"], moe
    assert report["openvino"]["version"].startswith(ov.get_version().split("-")[0])
    assert report["binding_plan"]["ranks"]
    # What the binding rule does for two ranks here: one per node, or the CPUs split.
    two = report["binding_plan"]["two_ranks"]
    assert [r["rank"] for r in two["ranks"]] == [0, 1]
    split = len(topo.usable_nodes()) < 2
    assert ("split" in two["source"]) == split, two


def test_doctor_text_and_bad_bind_string_warning() -> None:
    import os

    env = dict(os.environ, NUMAOV_CPU_BIND="0|4096")
    result = _doctor(env=env)
    assert result.returncode == 0, result.stderr
    assert "Binding plan" in result.stdout
    assert "entry 1 ('4096'): CPU 4096 is not an online CPU" in result.stdout


def test_doctor_reports_the_moe_bf16_kernel_under_numaov_moe_amx() -> None:
    import os

    off = _doctor("--json", env=dict(os.environ, NUMAOV_MOE_AMX="off"))
    assert off.returncode == 0, off.stderr
    moe = json.loads(off.stdout)["extension"]["moe"]
    formats = moe.pop("formats")
    int8 = {key: moe.pop(key) for key in ("int8_kernel", "int8_reason")}
    if read_topology().isa.avx512_vnni:
        assert int8 == {"int8_kernel": "vnni",
                        "int8_reason": "in a bf16 model; f32 models widen the weights to f32"}
        assert formats["int8"]["kernel"].startswith("AVX512-VNNI: int8 weights against "
                                                    "activations quantized per row in groups of 64")
    if read_topology().isa.avx512_bf16:
        assert moe == {"bf16_kernel": "avx512_bf16", "amx_min_rows": None,
                       "reason": "NUMAOV_MOE_AMX=off"}
        assert formats["bf16"] == {
            "kernel": "AVX512-BF16 outer products for experts of 16+ rows, dot products below",
            "reason": "NUMAOV_MOE_AMX=off"}
    # every format the op takes is named with the kernel it runs on here
    assert set(formats) == {"f32", "bf16", "int8", "int4", "fp8"}
    assert all(f["kernel"] or f["reason"] for f in formats.values()), formats
    assert "f32 FMA" in formats["fp8"]["kernel"] and "E4M3" in formats["fp8"]["kernel"]
    bad = _doctor(env=dict(os.environ, NUMAOV_MOE_AMX="yes"))
    assert bad.returncode == 0, bad.stderr
    assert ("bf16 MoE experts: cannot run (NUMAOV_MOE_AMX='yes'; expected auto, off or always)"
            in bad.stdout), bad.stdout
    assert "int8 MoE experts: AVX-512: int8 weights widened" in bad.stdout or (
        "int8 MoE experts: AVX512-VNNI" in bad.stdout), bad.stdout
    bad = _doctor(env=dict(os.environ, NUMAOV_MOE_VNNI="yes"))
    assert bad.returncode == 0, bad.stderr
    assert ("int8 MoE experts: cannot run (NUMAOV_MOE_VNNI='yes'; expected auto, off or "
            "always)" in bad.stdout), bad.stdout
    off = json.loads(_doctor("--json", env=dict(os.environ, NUMAOV_MOE_VNNI="off")).stdout)
    assert off["extension"]["moe"]["int8_kernel"] in ("f32", None)
    assert "widened to f32" in off["extension"]["moe"]["formats"]["int8"]["kernel"]


def test_doctor_text_says_what_two_ranks_would_get() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "NUMAOV_CPU_BIND"}
    result = _doctor(env=env)
    assert result.returncode == 0, result.stderr
    assert "  for 2 ranks:\n    source: default" in result.stdout
    assert "    rank 1: CPUs" in result.stdout

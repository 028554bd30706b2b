"""The MoeExperts kernel's AMX path for bf16 experts (moe_amx.cpp) against the float64
reference and against its AVX512-BF16 path, in one compiled OpenVINO model whose kernel reads
NUMAOV_MOE_AMX at every call (auto | off | always).

Sizes are chosen for the tiles' tails: hidden 100 (K of gate/up: three whole 32-value tile
rows and a tail of 4; N of down: six 16-row weight blocks and a tail of 4) and intermediate 37
(odd: K of down ends in a lone value, N of gate/up in a block of 5). Rows per expert 1, 2, 15,
16, 17, 64 and 1000 cover a partly filled tile, one whole tile, a tile and one row, whole
pairs of tiles, and long prefill; two experts get no rows.

Tolerances (max |got - expected| / max |expected|, per expert's rows):
- AMX against float64: 3e-2, the bf16 tolerance of test_moe_op.py (x, the weights and
  silu(gate) * up are each rounded to bf16; the sums are f32 in both paths).
- AMX against AVX512-BF16: 2e-3. Both round the same operands to bf16 and sum in f32; they
  differ in summation order (~1e-6) and so, now and then, in which way silu(gate) * up rounds
  to bf16 (2^-8 of one of 37 intermediate values, ~1e-3 at worst); measured 1e-7 .. 5e-5 here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.moe_kernel import relative_error
from test_moe_op import BF16_TOL, _compiled, _feeds, _reference

from numaov.custom_ops.moe_ops import (
    dequantize_experts,
    kernel_unavailable_reason,
    quantize_experts,
)
from numaov.native import native_module

AMX_MISSING = native_module().amx_unavailable_reason() or kernel_unavailable_reason("bf16")
pytestmark = pytest.mark.skipif(bool(AMX_MISSING), reason=f"needs AMX tiles: {AMX_MISSING}")

AMX_VS_AVX_TOL = 2e-3
HIDDEN, INTER, EXPERTS = 100, 37, 9
# rows per expert: expert e gets ROWS[e] rows (top-1), experts 7 and 8 none
ROWS = (1, 2, 15, 16, 17, 64, 1000, 0, 0)
AMX_MIN_ROWS = 2  # moe_kernels.cpp's kAmxMinRows


def _stacks(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return gate_up, down


def _routed(rows_per_expert: tuple[int, ...],
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, ids, weights of top-1 routing with rows_per_expert[e] rows on expert e, shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(rows_per_expert)
    ids = torch.repeat_interleave(torch.arange(len(rows_per_expert)),
                                  torch.tensor(rows_per_expert))
    ids = ids[torch.randperm(rows, generator=g)].reshape(rows, 1)
    x = torch.randn(rows, HIDDEN, generator=g)
    weights = torch.rand(rows, 1, generator=g)
    return x, ids, weights


@pytest.fixture(scope="module")
def amx_model(tmp_path_factory: pytest.TempPathFactory):
    gate_up, down = _stacks()
    run = _compiled(tmp_path_factory.mktemp("moe_amx"), gate_up, down, 1, "bf16").runner()
    return run, gate_up, down


def _run(run, monkeypatch: pytest.MonkeyPatch, setting: str, x, ids, weights) -> np.ndarray:
    monkeypatch.setenv("NUMAOV_MOE_AMX", setting)
    (got,) = run(_feeds(x, ids, weights))
    return got


def test_amx_matches_float64_and_the_avx512_path_at_every_row_count(
        amx_model, monkeypatch: pytest.MonkeyPatch) -> None:
    run, gate_up, down = amx_model
    x, ids, weights = _routed(ROWS, seed=1)
    reference = _reference(x, ids, weights, gate_up, down)
    amx = _run(run, monkeypatch, "always", x, ids, weights)
    avx = _run(run, monkeypatch, "off", x, ids, weights)
    assert not np.array_equal(amx, avx)  # two paths were run, not one twice
    for expert, count in enumerate(ROWS):
        mine = (ids[:, 0] == expert).numpy()
        assert int(mine.sum()) == count
        if count == 0:
            continue
        assert relative_error(amx[mine], reference[mine]) < BF16_TOL, count
        assert relative_error(amx[mine], avx[mine]) < AMX_VS_AVX_TOL, count


def test_auto_runs_experts_with_2_rows_or_more_on_amx(
        amx_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-1 routing: each output row comes from one expert, so the automatic choice is
    visible per row: bit for bit the AMX result for experts of >= 2 rows, the AVX512-BF16
    result for one."""
    run, _, _ = amx_model
    x, ids, weights = _routed(ROWS, seed=2)
    auto = _run(run, monkeypatch, "auto", x, ids, weights)
    amx = _run(run, monkeypatch, "always", x, ids, weights)
    avx = _run(run, monkeypatch, "off", x, ids, weights)
    for expert, count in enumerate(ROWS):
        mine = (ids[:, 0] == expert).numpy()
        if count:
            assert np.array_equal(auto[mine], (amx if count >= AMX_MIN_ROWS else avx)[mine]), count


def test_amx_with_several_experts_per_row(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-6 over 16 experts at 1, 7 and 130 rows: the rows' pairs sum over
    experts on both paths (the down pass adds each AMX block into the rows it belongs to)."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(16, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(16, HIDDEN, INTER, generator=g) / INTER**0.5
    run = _compiled(tmp_path, gate_up, down, 6, "bf16").runner()
    for rows in (1, 7, 130):
        x = torch.randn(rows, HIDDEN, generator=g)
        weights, ids = torch.topk(torch.rand(rows, 16, generator=g), 6, dim=-1)
        reference = _reference(x, ids, weights, gate_up, down)
        amx = _run(run, monkeypatch, "always", x, ids, weights)
        avx = _run(run, monkeypatch, "off", x, ids, weights)
        assert relative_error(amx, reference) < BF16_TOL, rows
        assert relative_error(amx, avx) < AMX_VS_AVX_TOL, rows


def test_fp8_experts_of_many_rows_run_on_the_tiles_as_their_bf16_dequantization(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a bf16 model, fp8 experts of many rows are dequantized to bf16 block by block and
    run on the same tiles as bf16 experts: with AMX always and off, bit for bit what bf16
    stacks holding those dequantized weights give (test_moe_op's
    test_fp8_experts_in_a_bf16_model checks the choice of path)."""
    gate_up, down = _stacks(seed=7)
    (qg, sg), (qd, sd) = (quantize_experts(w, "fp8") for w in (gate_up, down))
    for name in ("fp8", "bf16"):
        (tmp_path / name).mkdir()
    fp8 = _compiled(tmp_path / "fp8", qg, qd, 1, "bf16", (sg, sd)).runner()
    bf16 = _compiled(tmp_path / "bf16", dequantize_experts(qg, sg), dequantize_experts(qd, sd),
                     1, "bf16").runner()
    x, ids, weights = _routed((16, 17, 64, 20, 0, 0, 0, 0, 0), seed=4)
    x = x.bfloat16().float()
    for setting in ("always", "off"):
        got = _run(fp8, monkeypatch, setting, x, ids, weights)
        assert np.array_equal(got, _run(bf16, monkeypatch, setting, x, ids, weights)), setting


def test_a_bad_setting_is_refused_by_name(amx_model, monkeypatch: pytest.MonkeyPatch) -> None:
    run, _, _ = amx_model
    x, ids, weights = _routed((2, 2, 0, 0, 0, 0, 0, 0, 0), seed=3)
    with pytest.raises(RuntimeError, match=r"NUMAOV_MOE_AMX='tiles'; expected auto, off or always"):
        _run(run, monkeypatch, "tiles", x, ids, weights)

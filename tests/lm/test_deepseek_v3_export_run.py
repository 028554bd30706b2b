"""DeepSeek-V3 through the unchanged numaov pipeline: ``export_lm`` for dp=2 (the family from
the registry by the checkpoint's model_type) and ``run_lm`` on two pinned OpenVINO rank
workers, whose greedy tokens equal transformers' on the same checkpoint at f32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.deepseek_v3_harness import PROMPTS, hf_greedy, save_hf_checkpoint

from numaov.exporter.lm_export import export_lm
from numaov.runtime.lm.engine import SamplingParams, run_lm

pytestmark = pytest.mark.slow  # exports two rank graphs and runs two rank workers

NEW_TOKENS = 6


def test_export_dp2_and_run_match_transformers_greedy(
    tmp_path: Path, deepseek_bind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMAOV_CPU_BIND", deepseek_bind)
    hf, checkpoint = save_hf_checkpoint(tmp_path / "checkpoint")
    manifest = export_lm(checkpoint, tmp_path / "model", dp=2)
    written = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert written["family"] == "deepseek_v3" and written["cache_layout"]["kind"] == "mla"
    assert written["world_size"] == 2 and manifest.world_size == 2
    # the export's own parity check (both rank graphs against torch) passed
    for figure in written["parity"]:
        print(f"export parity {figure}")
    assert all(figure["passed"] for figure in written["parity"])
    # f32 graphs (INFERENCE_PRECISION_HINT=f32): greedy tokens are transformers' own (its
    # cache, one prompt at a time) against numaov's cache pool, DP scheduler and two ranks
    result = run_lm(tmp_path / "model", PROMPTS, NEW_TOKENS, "openvino",
                    params=SamplingParams(NEW_TOKENS, ignore_eos=True))
    assert result.world_size == 2
    assert result.tokens == [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]

"""A Qwen2-MoE checkpoint written by transformers, exported through the unchanged LM pipeline
(``export_lm``, which runs its own OpenVINO parity check per rank) at dp=1 and dp=2 and run with
the LM engine (``run_lm``): greedy tokens equal transformers' own greedy generation at f32, and
dp=2's equal dp=1's.

Qwen2-MoE rather than Qwen3-MoE: it has everything the sharded graph must get right (q/k/v
biases, a dense layer, routed experts, the shared expert split by intermediate with its
replicated sigmoid gate); Qwen3-MoE's only addition, the per-head q/k RMSNorm, is the same
``norm_infer`` op every RMSNorm exports through, and its eager parity is in
``test_qwen_moe_model.py``.

The checkpoint ties its head to the embedding over an odd vocabulary (253 ids): at dp=2 each
rank holds its own 127-row slice of the head, the second ending in a zero row, and computes its
slice of every rank's logits (``data_parallel.logits_from_vocab_shards``), which the tokens
check end to end.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from support.qwen_moe_harness import hf_greedy, save_checkpoint

from numaov.exporter.lm_export import export_lm
from numaov.runtime.lm.engine import SamplingParams, run_lm

pytestmark = pytest.mark.slow  # two exports and two engine runs (~100 s on a 2-core machine)

SEED = 7
MAX_NEW_TOKENS = 6
# rank 0 gets prompts 0 and 2, rank 1 prompt 1 at dp=2; different lengths, so left padding
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [200, 2], [77, 12, 19, 101]]
VOCAB = 253  # odd: dp=2's head slices are 127 rows, the last one zero


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("qwen_moe_export")
    model, checkpoint = save_checkpoint(root / "checkpoint", "qwen2_moe", SEED,
                                        tie_word_embeddings=True, vocab_size=VOCAB)
    out = {"reference": hf_greedy(model, PROMPTS, MAX_NEW_TOKENS)}
    for dp in (1, 2):
        start = time.perf_counter()
        export_lm(checkpoint, root / f"dp{dp}", dp=dp)
        out[dp] = root / f"dp{dp}"
        print(f"export dp={dp}: {time.perf_counter() - start:.1f} s")
    return out


def test_export_and_run_match_transformers_at_dp1_and_dp2(
    exported: dict[str, Any], deepseek_bind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = {}
    for dp in (1, 2):
        manifest = json.loads((exported[dp] / "manifest.json").read_text())
        assert manifest["family"] == "qwen_moe" and manifest["world_size"] == dp
        assert manifest["cache_layout"]["kind"] == "gqa"
        assert manifest["cache_layout"]["width"] == 2 * 2 * 16
        assert all(figure["passed"] for figure in manifest["parity"])
        # dp=2: one rank on each of two CPUs; dp=1: the first of them
        bind = deepseek_bind if dp == 2 else deepseek_bind.split("|")[0]
        monkeypatch.setenv("NUMAOV_CPU_BIND", bind)
        start = time.perf_counter()
        result = run_lm(exported[dp], PROMPTS, MAX_NEW_TOKENS, "openvino",
                        params=SamplingParams(MAX_NEW_TOKENS, ignore_eos=True))
        print(f"run dp={dp}: {time.perf_counter() - start:.1f} s, tokens {result.tokens}")
        assert result.world_size == dp
        tokens[dp] = result.tokens
    assert tokens[1] == exported["reference"], "dp=1 greedy tokens differ from transformers'"
    assert tokens[2] == tokens[1], "dp=2 greedy tokens differ from dp=1's"


def test_serve_reads_tool_calls_with_the_familys_parser(exported: dict[str, Any],
                                                        tmp_path) -> None:
    """Without --tool-call-parser, a Qwen export's calls are read with hermes (Qwen's
    format); a tokenizer that cannot write hermes' tags back leaves it off, saying why."""
    from support.deepseek_harness import tiny_tokenizer
    from support.service_harness import template_tokenizer

    from numaov.cli import _family_tool_call_parser
    from numaov.runtime.service.lm_requests import ChatOptions

    said: list[str] = []
    qwen = template_tokenizer(tmp_path / "qwen", "qwen3")
    chat = _family_tool_call_parser(ChatOptions(), str(exported[1]), qwen, said.append)
    assert chat.tool_call_parser == "hermes" and not said
    chosen = ChatOptions(tool_call_parser="deepseek_v3")  # the flag wins
    assert _family_tool_call_parser(chosen, str(exported[1]), qwen, said.append) is chosen
    plain = _family_tool_call_parser(ChatOptions(), str(exported[1]),
                                     tiny_tokenizer(tmp_path / "plain"), said.append)
    assert plain.tool_call_parser is None
    assert len(said) == 1 and "family's parser hermes cannot be used" in said[0]

"""DeepSeek-V2 per-rank export and the DP-attention LM engine: the OpenVINO rung of the parity
ladder (OpenVINO dp=2 with the extension ops == torch dp=1), the CLI, and the errors.

The tiny builtin model is exported once for dp=2 through the CLI (which also runs the export's
own parity check with the two rank graphs in two worker processes); the generation tests run
two pinned workers on the two allowed CPUs (``NUMAOV_CPU_BIND``) against the unsharded PyTorch
model generating in one process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from support.deepseek_harness import (
    CLI,
    CLI_TIMEOUT_S,
    MAX_NEW_TOKENS,
    SCENARIOS,
    greedy_reference,
    tiny_tokenizer,
)

from numaov.custom_ops import OnnxRuntimeUnsupportedError, check_onnxruntime_can_run
from numaov.exporter.lm_export import COLLECTIVE_GROUP, export_lm
from numaov.models.checkpoint import CheckpointError
from numaov.models.deepseek_v2 import DeepseekV2, ShardError
from numaov.models.layers.sharding import head_rows
from numaov.runtime.lm.engine import (
    GenerationInputError,
    RankPlanError,
    SamplingParams,
    parse_prompt_ids,
    plan_for_ranks,
    run_lm,
)
from numaov.runtime.placement.binding import BindingPlan
from numaov.runtime.placement.topology import read_topology

pytestmark = pytest.mark.slow  # exports the tiny DeepSeek and runs rank workers

# f32 on both sides (the IR is compiled with INFERENCE_PRECISION_HINT=f32). dp=2 sums each MLP
# output from two half-width partial sums through the shared-memory reduce-scatter, and
# OpenVINO reorders the f32 math (fused FullyConnected, other blockings): logits differ from
# eager dp=1 by float32 rounding, ~3e-6 measured on logits of magnitude ~1-10. 1e-4 leaves
# a wide margin and is far below the top-1 / top-2 logit gaps the greedy tokens depend on.
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4


@pytest.fixture(scope="module")
def bind(deepseek_bind: str) -> str:
    return deepseek_bind


@pytest.fixture(scope="module")
def exported(deepseek_exported: dict[str, Any]) -> dict[str, Any]:
    """The tiny model exported once for dp=2 through the CLI, and torch dp=1 references."""
    return deepseek_exported


# -- export -----------------------------------------------------------------------------------


def test_export_writes_rank_graphs_with_collectives_and_one_manifest(exported) -> None:
    model_dir = exported["model_dir"]
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["kind"] == "lm" and manifest["family"] == "deepseek_v2"
    assert manifest["cache_layout"]["kind"] == "mla"
    assert manifest["world_size"] == 2
    assert manifest["collective_group"] == COLLECTIVE_GROUP
    assert [r["ir_xml"] for r in manifest["ranks"]] == ["rank_0/model.xml", "rank_1/model.xml"]
    shapes = {spec["name"]: spec["shape"] for spec in manifest["inputs"]}
    assert shapes["input_ids"] == ["batch", "new_tokens"]
    assert shapes["attention_mask"] == ["batch", "total_tokens"]
    assert shapes["past_slots"] == ["batch", "past_tokens"]
    assert shapes["kv_cache"][1] == "cache_tokens"
    assert {s["name"]: s["shape"] for s in manifest["outputs"]}["new_key_values"][1:3] == [
        "batch", "new_tokens"]
    assert manifest["config"]["n_routed_experts"] == 8
    # the export's own parity: both ranks' outputs checked, all within tolerance
    outputs = {figure["output"] for figure in manifest["parity"]}
    assert {"rank0.logits", "rank1.logits", "rank1.new_key_values"} <= outputs
    assert all(figure["passed"] for figure in manifest["parity"])
    assert any("onnxruntime not checked" in note for note in manifest["notes"])
    for rank in range(2):
        graph = onnx.load(str(model_dir / f"rank_{rank}/model.onnx"), load_external_data=False)
        collectives = [n for n in graph.graph.node if n.domain == "numaov.collective"]
        # one gather of the row counts, then a gather + reduce-scatter around each of 3
        # layers; around the head a gather of its row counts and of its rows, and the
        # all-to-all of the logit slices
        assert sorted(n.op_type for n in collectives) == ["AllGatherIntoTensor"] * 6 + [
            "AllToAll"] + ["ReduceScatterTensor"] * 3
        head = next(t for t in graph.graph.initializer if t.name.endswith("lm_head.weight"))
        rows = head_rows(manifest["config"]["vocab_size"], 2)
        assert list(head.dims) == [rows, manifest["config"]["hidden_size"]]
        for node in collectives:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs == {"group": COLLECTIVE_GROUP.encode(), "world_size": 2}
    with pytest.raises(OnnxRuntimeUnsupportedError):
        check_onnxruntime_can_run(model_dir / "rank_0/model.onnx")


def _reaches(start, kind: str, upstream: bool, limit: int = 64) -> bool:
    """Whether a node of type `kind` lies within `limit` nodes of `start`, walking breadth-first
    up its inputs or down its outputs. Breadth-first, because OpenVINO lists a node's consumers
    in no fixed order: a depth-first walk could spend the limit down the residual stream into
    the next layer before it reached the reduce-scatter one step away."""
    seen, todo = {start.get_name()}, deque([start])
    while todo and len(seen) <= limit:
        node = todo.popleft()
        if node.get_type_name() == kind and node is not start:
            return True
        if upstream:
            near = [v.get_node() for v in node.input_values()]
        else:
            near = [t.get_node() for o in node.outputs() for t in o.get_target_inputs()]
        for other in near:
            if other.get_name() not in seen:  # names are unique; Python wrappers are not
                seen.add(other.get_name())
                todo.append(other)
    return False


def test_compiled_rank_graph_runs_the_moe_op_between_gather_and_reduce_scatter(exported) -> None:
    """Each MoE layer is one MoeExperts op on the rank's expert store, fed by the all-gather
    and feeding the reduce-scatter; the compiled runtime graph runs it (as a Reference layer)
    and holds no If and no Gather of an expert stack (the per-(row, expert) weight copy)."""
    import openvino as ov

    from numaov.custom_ops import add_extension, compile_ir
    from numaov.custom_ops.expert_store import STORE_NAME, open_store

    model_dir = exported["model_dir"]
    config = json.loads((model_dir / "manifest.json").read_text())["config"]
    experts, hidden = config["n_routed_experts"], config["hidden_size"]
    core = ov.Core()
    add_extension(core)
    xml = model_dir / "rank_0/model.xml"
    model = core.read_model(str(xml))
    moe = [n for n in model.get_ordered_ops() if n.get_type_name() == "MoeExperts"]
    assert len(moe) == config["num_hidden_layers"] - config["first_k_dense_replace"]
    shard = config["moe_intermediate_size"] // 2
    # the node names the rank's expert store and its layer; the store holds the rank's shard
    store = open_store(model_dir / "rank_0" / STORE_NAME)
    for node in moe:
        attributes = node.get_attributes()
        assert node.get_input_size() == 3 and attributes["store"] == STORE_NAME
        assert attributes["store_id"] == store.store_id
        stacks = store.layers[attributes["layer"]]
        assert list(stacks.gate_up.shape) == [experts, 2 * shard, hidden]
        assert list(stacks.down.shape) == [experts, hidden, shard]
        assert _reaches(node, "AllGatherIntoTensor", upstream=True)
        assert _reaches(node, "ReduceScatterTensor", upstream=False)
    runtime = compile_ir(xml, "f32").model.get_runtime_model().get_ordered_ops()
    layers = [(op.get_rt_info()["layerType"].astype(str),
               op.get_rt_info()["originalLayersNames"].astype(str).split(","), op)
              for op in runtime]
    for node in moe:
        assert any(kind == "Reference" and node.get_friendly_name() in names
                   for kind, names, _ in layers), node.get_friendly_name()
    assert not [names for kind, names, _ in layers if kind == "If"]
    stacks = {(experts, 2 * shard, hidden), (experts, hidden, shard)}
    expert_stacks = [op for kind, _, op in layers if kind == "Gather"
                     and op.get_input_partial_shape(0).is_static
                     and tuple(op.get_input_partial_shape(0).to_shape()) in stacks]
    assert not expert_stacks


def test_absorbed_attention_weights_multiply_every_sequence_at_once(exported) -> None:
    """MLA's absorbed kv_b_proj halves ([heads, ., .] weights) multiply one [heads, B*T, .]
    matrix of every sequence's rows, not a [B, heads, T, .] batch broadcast against them, which
    OpenVINO ran as B * heads one-row products (a V3-shaped step at 8 sequences 1.11x slower;
    benchmarks/RESULTS.md)."""
    import openvino as ov

    from numaov.custom_ops import add_extension

    model_dir = exported["model_dir"]
    config = json.loads((model_dir / "manifest.json").read_text())["config"]
    heads = config["num_attention_heads"]
    core = ov.Core()
    add_extension(core)
    model = core.read_model(str(model_dir / "rank_0/model.xml"))
    absorbed = [op for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"
                and op.get_input_partial_shape(1).is_static
                and len(op.get_input_partial_shape(1)) == 3
                and op.get_input_partial_shape(1)[0].get_length() == heads]
    assert len(absorbed) == 2 * config["num_hidden_layers"]
    for op in absorbed:
        rows = op.get_input_partial_shape(0)
        assert len(rows) == 3 and rows[0].get_length() == heads, (op.get_friendly_name(), rows)


def test_dp_not_dividing_the_sharded_dims_is_a_clear_cli_error(exported, tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CLI, "export", "lm", "--checkpoint", str(exported["checkpoint"]), "--dp", "3",
         "--out", str(tmp_path / "out"), "--quiet"],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )
    assert proc.returncode == 1
    # the tiny model's sharded dims: 128 (dense MLP), 32 (experts), 64 (shared experts)
    assert "numaov: error: --dp: dp=3 does not divide" in proc.stderr and "moe_intermediate_size=32" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_checkpoint_that_does_not_fit_its_config_is_a_clear_error(
    exported, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(exported["checkpoint"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["moe_intermediate_size"] = 16  # the tensors on disk are 32 wide
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mis-shaped|shape"):
        export_lm(broken, tmp_path / "out", dp=2)
    with pytest.raises(ShardError, match="dp=3 does not divide"):
        export_lm(exported["checkpoint"], tmp_path / "out3", dp=3)


# -- the OpenVINO dp=2 rung of the parity ladder ----------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_openvino_dp2_matches_torch_dp1(
    exported, bind: str, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMAOV_CPU_BIND", bind)
    prompts = SCENARIOS[scenario]
    result = run_lm(exported["model_dir"], prompts, MAX_NEW_TOKENS, "openvino",
                          params=SamplingParams(MAX_NEW_TOKENS, ignore_eos=True),
                          keep_logits=True)
    ref_tokens, ref_logits = exported["references"][scenario]
    assert result.world_size == 2
    assert result.tokens == ref_tokens, f"{scenario}: greedy tokens differ from torch dp=1"
    logits = torch.from_numpy(np.stack(result.logits))
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    assert len(result.step_seconds) == MAX_NEW_TOKENS
    assert result.tokens_per_second > 0


# -- CLI run ----------------------------------------------------------------------------------


def _run_cli(exported, bind: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "run", "lm", "--model-dir", str(exported["model_dir"]),
         "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet", *args],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        env={**os.environ, "NUMAOV_CPU_BIND": bind},
    )


def test_cli_run_prints_the_tokens_of_every_prompt_in_order(exported, bind: str) -> None:
    prompts = SCENARIOS["three"]
    ids = ";".join(",".join(map(str, p)) for p in prompts)
    proc = _run_cli(exported, bind, "--prompt-ids", ids, "--backend", "torch", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    ref_tokens = exported["references"]["three"][0]
    for i, (prompt, tokens) in enumerate(zip(prompts, ref_tokens, strict=True)):
        assert lines[i] == f"[{i}] {','.join(map(str, prompt))} -> {','.join(map(str, tokens))}"
    assert "on torch with 2 rank(s)" in lines[-1]


def test_cli_run_with_a_tokenizer_takes_and_prints_text(
    exported, bind: str, tmp_path: Path
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    texts = ["the cat sat on a mat", "hello world"]
    proc = _run_cli(exported, bind, "--tokenizer", str(tmp_path / "tok"),
                    "--prompt", texts[0], "--prompt", texts[1], "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    model = DeepseekV2.from_pretrained(exported["checkpoint"])
    prompts = [tokenizer.encode(t).ids for t in texts]
    expected, _ = greedy_reference(model, prompts, MAX_NEW_TOKENS)
    lines = proc.stdout.strip().splitlines()
    for i, (text, tokens) in enumerate(zip(texts, expected, strict=True)):
        assert lines[i] == f"[{i}] {text!r} -> {tokenizer.decode(tokens)!r}"


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-ids", "1,2;x"], "'x' in prompt 1 is not a token id"),
    (["--prompt-ids", "1,2;;3"], "prompt 1 is empty"),
    (["--prompt-ids", "1,600"], r"token id\(s\) \[600\] outside the vocabulary"),
    (["--prompt", "hello"], "--prompt TEXT needs a tokenizer: .* has no tokenizer.json"),
    ([], "give the prompts once"),
])
def test_cli_run_rejects_bad_prompts_with_one_line(
    exported, bind: str, args: list[str], message: str
) -> None:
    import re

    proc = _run_cli(exported, bind, *args)
    assert proc.returncode == 1
    assert re.search(message, proc.stderr), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# -- engine arguments, placement and prompt order ---------------------------------------------


def test_prompt_parsing_and_generation_arguments(exported, bind: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_prompt_ids(" 1, 2 ,3;4,5 ") == [[1, 2, 3], [4, 5]]
    for text in ("", ";", "1,,2", "1;-2", "1.5"):
        with pytest.raises(GenerationInputError):
            parse_prompt_ids(text)
    monkeypatch.setenv("NUMAOV_CPU_BIND", bind)
    model_dir = exported["model_dir"]
    with pytest.raises(GenerationInputError, match="prompt 1 is empty"):
        run_lm(model_dir, [[1], []], 2)
    with pytest.raises(GenerationInputError, match="max_new_tokens is 0"):
        run_lm(model_dir, [[1]], 0)
    with pytest.raises(GenerationInputError, match="max_position_embeddings=256"):
        run_lm(model_dir, [[1] * 250], 10)
    with pytest.raises(GenerationInputError, match="unknown backend"):
        run_lm(model_dir, [[1]], 2, "onnxruntime")


def test_a_plan_with_another_rank_count_says_to_set_the_bind_variable(
    exported, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    monkeypatch.setenv("NUMAOV_CPU_BIND", str(cpu))
    with pytest.raises(RankPlanError, match=r"dp=2 runs one worker per rank.*1 CPU list\(s\)"):
        run_lm(exported["model_dir"], [[1, 2]], 2)
    one_rank = BindingPlan.from_bind_string(str(cpu), read_topology())
    with pytest.raises(RankPlanError, match=r"1 rank\(s\) but .* dp=2.*NUMAOV_CPU_BIND"):
        run_lm(exported["model_dir"], [[1, 2]], 2, plan=one_rank)


def test_split_plan_gives_every_rank_its_own_cpus_without_a_bind_string() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    plan, placement = plan_for_ranks(2, env={})
    assert plan.world_size == 2 and "rank 1 on CPUs" in placement
    if len(allowed) >= 2:
        assert not set(plan.ranks[0].cpus) & set(plan.ranks[1].cpus)
    assert set().union(*(r.cpus for r in plan.ranks)) <= set(allowed)


def test_bench_deepseek_compares_backends_on_the_rank_workers(
    exported, bind: str, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [*CLI, "bench", "lm", "--model-dir", str(exported["model_dir"]), "--batch", "3",
         "--prompt-length", "5", "--max-new-tokens", "3", "--rounds", "1", "--json", str(out),
         "--quiet"],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        env={**os.environ, "NUMAOV_CPU_BIND": bind},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["backend"] for r in report["rows"]] == ["torch", "openvino"]
    assert "3 prompt(s) x 5 tokens + 3 new, dp=2" in report["what"]
    for row in report["rows"]:
        assert row["prefill_ms"] > 0 and row["decode_ms_per_step"] > 0
    # f32 torch and OpenVINO over the same collectives pick the same greedy tokens
    assert report["rows"][1]["same_tokens"] is True
    assert "x 1.00 vs torch" in proc.stdout


def test_corrupt_rank_ir_is_one_line_naming_the_file_in_run_and_serve(
    exported, bind: str, tmp_path: Path
) -> None:
    """A rank's model.bin changed after the export (same size, other bytes) is found before
    OpenVINO compiles it, inside that rank's worker, and reported as one line naming it."""
    model_dir = tmp_path / "model"
    shutil.copytree(exported["model_dir"], model_dir)
    bin_path = model_dir / "rank_1" / "model.bin"
    data = bytearray(bin_path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    bin_path.write_bytes(bytes(data))
    env = {**os.environ, "NUMAOV_CPU_BIND": bind}
    for argv in (["run", "deepseek", "--model-dir", str(model_dir), "--prompt-ids", "5,17",
                  "--max-new-tokens", "2", "--quiet"],
                 ["serve", "--model-dir", str(model_dir), "--port", "0", "--quiet"]):
        proc = subprocess.run([*CLI, *argv], capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S, env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert "rank_1/model.bin' does not hold what the export wrote" in lines[0], lines

"""The LM engine against optimum-intel, side by side in one run, on one DeepSeek-V2 checkpoint.

A DeepSeek-V2-shaped checkpoint (hidden 1024, 4 layers: one dense, three MoE with 16 routed + 2
shared experts, top-6, kv_lora_rank 256, q_lora_rank 384, vocab 16384; 537 MB in f32) is built
from seeded weights, exported by numaov (dp=1 and dp=2) and by optimum-intel
(``OVModelForCausalLM``, stateful), and both decode the same seeded prompts:

- ``decode``: decode tokens/s at 1, 8 and 32 concurrent requests (prompt 32 tokens, 64 greedy
  tokens each, end-of-sequence ignored), numaov dp=1 (both cores to one rank), numaov dp=2
  (``NUMAOV_CPU_BIND="0|1"``) and optimum-intel (both cores), each kept running across
  ``--rounds`` alternating rounds (medians and ranges), in the ``--weights`` format on both
  sides (int8 / int4: numaov's ``--weights``, optimum-intel's NNCF weight compression at the
  same symmetry and group size), and whether the greedy tokens are the same as optimum-intel's.
  fp8 (numaov's E4M3 experts with 128 x 128 block scales, quantized from this checkpoint's f32
  per block; weight-only, widened in the kernel): optimum-intel has no fp8 weight-only
  format, so its side runs the closest: int8 weights (NNCF ``INT8_SYM``, one byte per weight
  as fp8, computing in f32) at f32 precision, bf16 weights at bf16 (``OPTIMUM_WEIGHTS``).
  ``--also PRECISION:WEIGHTS,...`` adds, to the same alternating rounds, a numaov dp=1 engine
  per other format (and optimum-intel at that format, once per format it runs), so e.g. fp8
  and bf16 decode are timed side by side (``ratios`` then gives dp=1's tokens/s against each);
- ``context``: time per decode step of one request at 128, 1,024 and 4,096 cached tokens;
- ``kv``: the KV-cache candidates on the MLA cache (dp=1, one step graph each): numaov's pool
  (``kv_cache`` in, new entries out), the same pool at 8x the capacity (a copy in would show),
  the whole past in and the whole present out (the engine before the pool), OpenVINO's stateful
  transformation of that graph, and whether OpenVINO's paged-attention transformation applies.

optimum-intel runs in its own venv (``benchmarks/optimum_venv.sh``), never in numaov's. The
figures go to ``benchmarks/out/lm_engine_<precision>_<weights>.json``; ``benchmarks/RESULTS.md``
records them.
Run on a quiet machine: ``uptime`` is printed at the start and the end.

    .venv/bin/python benchmarks/lm_engine.py [--sections decode,context,kv] [--precision f32]
        [--weights f32|bf16|int8|int4|fp8] [--rounds 3] [--also bf16:bf16,bf16:fp8]
        [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from machine import cpu_model  # benchmarks/machine.py, beside this file
from moe import BENCH_CONFIG  # benchmarks/moe.py, beside this file

from numaov.models.builtin.deepseek_tiny import init_tiny_weights
from numaov.models.deepseek_v2 import DeepseekV2

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "lm_engine_{precision}_{weights}.json"
WORK = HERE / "out" / "lm_engine"
OPTIMUM_PYTHON = HERE / ".optimum-venv" / "bin" / "python"
SEED = 0
PROMPT_LEN = 32
NEW_TOKENS = 64
BATCHES = (1, 8, 32)
# what optimum-intel runs for a numaov format it has no equal of, per inference precision
OPTIMUM_WEIGHTS = {("fp8", "f32"): "int8", ("fp8", "bf16"): "bf16"}
CONTEXTS = (128, 1024, 4096)
CONTEXT_STEPS = 16

# moe.py's DeepSeek-V2 shape with the checkpoint sizes: 4 layers, 16 routed experts of
# 512, positions for the 4,096-token contexts; 537 MB in f32.
LM_BENCH_CONFIG = dataclasses.replace(
    BENCH_CONFIG, moe_intermediate_size=512, num_hidden_layers=4, n_routed_experts=16,
    max_position_embeddings=8192, eos_token_id=1)


def log(message: str) -> None:
    print(f"[lm_engine] {message}", file=sys.stderr, flush=True)


def uptime() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def prompts(count: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    # ids from 2: 0 is the pad id, 1 the end-of-sequence id
    return rng.integers(2, LM_BENCH_CONFIG.vocab_size, size=(count, length)).tolist()


# -- the checkpoint and the exports -----------------------------------------------------------


def build_checkpoint() -> Path:
    directory = WORK / "checkpoint"
    if (directory / "config.json").is_file():
        return directory
    log("building the 537 MB checkpoint")
    model = DeepseekV2.empty(LM_BENCH_CONFIG)
    init_tiny_weights(model, torch.Generator().manual_seed(SEED))
    model.save_pretrained(directory)
    return directory


def numaov_export(checkpoint: Path, dp: int, precision: str, weights: str) -> Path:
    from numaov.exporter.lm_export import export_lm

    out = WORK / f"numaov_dp{dp}_{precision}_{weights}"
    if (out / "manifest.json").is_file():
        return out
    log(f"numaov export dp={dp} {precision}, {weights} weights")
    os.environ["NUMAOV_CPU_BIND"] = "0|1" if dp == 2 else "0-1"
    export_lm(checkpoint, out, dp=dp, precision=precision, weights=weights, progress=log,
                    force=True)
    return out


# -- numaov: the engine -----------------------------------------------------------------------


class EngineDecoder:
    """One numaov engine kept running across the rounds (its workers load and compile once)."""

    def __init__(self, model_dir: Path, dp: int) -> None:
        from numaov.runtime.lm.engine import LMEngine, SamplingParams

        os.environ["NUMAOV_CPU_BIND"] = "0|1" if dp == 2 else "0-1"
        self.name = f"numaov dp={dp}"
        self._params = SamplingParams(NEW_TOKENS, ignore_eos=True)
        self._engine = LMEngine.start(model_dir, "openvino", cache_tokens=max(BATCHES) * 128)
        self.name = f"numaov dp={dp} ({model_dir.name})"
        self._engine.generate(prompts(2), SamplingParams(4, ignore_eos=True))  # warm-up

    def decode(self, batch: int) -> dict[str, Any]:
        """Decode tokens/s of ``batch`` requests submitted at once, timed from the first step
        after every prompt's prefill to the last token."""
        engine = self._engine
        before = len(engine.step_seconds)
        done = engine.generate(prompts(batch), self._params)
        steps = engine.step_seconds[before:]
        decode = steps[1:]  # step 0 holds every prefill (batch * 32 tokens < one chunk per rank)
        return {"decode_tokens_per_s": batch * len(decode) / sum(decode),
                "decode_step_ms_median": 1e3 * statistics.median(decode),
                "prefill_ms": 1e3 * steps[0], "steps": len(steps),
                "tokens": [c.tokens for c in done]}

    def close(self) -> None:
        self._engine.close()


def engine_context(model_dir: Path, dp: int) -> dict[str, Any]:
    """Decode step time of one request at each cached context length (the prompt is the
    context; prefill in chunks, then CONTEXT_STEPS decode steps timed)."""
    from numaov.runtime.lm.engine import LMEngine, SamplingParams

    os.environ["NUMAOV_CPU_BIND"] = "0|1" if dp == 2 else "0-1"
    out = {}
    with LMEngine.start(model_dir, "openvino", cache_tokens=max(CONTEXTS) + 64,
                        prefill_chunk=512) as engine:
        for context in CONTEXTS:
            before = len(engine.step_seconds)
            engine.generate(prompts(1, context), SamplingParams(CONTEXT_STEPS + 1,
                                                                ignore_eos=True))
            decode = engine.step_seconds[before:][-CONTEXT_STEPS:]
            out[str(context)] = 1e3 * statistics.median(decode)
            log(f"numaov dp={dp} context {context}: {out[str(context)]:.2f} ms/step")
    return out


# -- the KV-cache candidates ------------------------------------------------------------------


def kv_candidates(checkpoint: Path, numaov_dir: Path) -> dict[str, Any]:
    """One decode step of one sequence per candidate at each context, dp=1 f32, 2 threads."""
    import openvino as ov
    from openvino._offline_transformations import apply_make_stateful_transformation

    from numaov.custom_ops import compile_ir
    from numaov.exporter.openvino_convert import convert_to_ir

    c = LM_BENCH_CONFIG
    layers, width = c.num_hidden_layers, c.kv_cache_dim
    props = {"INFERENCE_NUM_THREADS": 2}
    rng = np.random.default_rng(SEED)
    results: dict[str, Any] = {"pool": {}, "pool_8x_capacity": {}, "whole_cache_in_out": {},
                               "stateful": {}, "paged_attention": None}

    def timed(run, reps: int = 10) -> float:
        run()
        seconds = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        return 1e3 * statistics.median(seconds)

    # 1. numaov's pool, bound once over shared memory
    compiled = compile_ir(numaov_dir / "rank_0" / "model.xml", "f32", props).model
    for key, scale in (("pool", 1), ("pool_8x_capacity", 8)):
        pool = rng.standard_normal((layers, scale * (max(CONTEXTS) + 8), width),
                                   dtype=np.float32)
        request = compiled.create_infer_request()
        request.set_tensor("kv_cache", ov.Tensor(pool, shared_memory=True))
        for context in CONTEXTS:
            feeds = {"input_ids": np.array([[5]]), "position_ids": np.array([[context]]),
                     "attention_mask": np.ones((1, context + 1), dtype=np.int64),
                     "past_slots": np.arange(context, dtype=np.int64)[None]}

            def step(feeds=feeds, request=request, pool=pool, context=context) -> None:
                request.infer(feeds)
                pool[:, context] = request.get_tensor("new_key_values").data[:, 0, 0]

            results[key][str(context)] = timed(step)
            log(f"kv {key} context {context}: {results[key][str(context)]:.2f} ms")
    del compiled

    # 2. the whole past in, the whole present out (DeepseekV2.step), and its stateful form
    xml = WORK / "explicit_cache" / "model.xml"
    if not xml.is_file():
        model = DeepseekV2.from_pretrained(checkpoint)

        class ExplicitStep(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids, position_ids, attention_mask, past_key_values):
                logits, present = self.model.step(input_ids, position_ids, attention_mask,
                                                  past_key_values)
                return logits[:, -1], present

        dim = torch.export.Dim
        example = (torch.tensor([[5, 6, 7]]), torch.tensor([[4, 5, 6]]),
                   torch.ones(1, 7, dtype=torch.long), torch.zeros(layers, 1, 4, width))
        onnx_path = xml.with_suffix(".onnx")
        onnx_path.parent.mkdir(parents=True, exist_ok=True)
        from numaov.custom_ops import onnx_translation_table

        torch.onnx.export(
            ExplicitStep(), example, str(onnx_path), dynamo=True,
            input_names=["input_ids", "position_ids", "attention_mask", "past_key_values"],
            output_names=["logits", "present_key_values"],
            dynamic_shapes={"input_ids": {1: dim.DYNAMIC}, "position_ids": {1: dim.DYNAMIC},
                            "attention_mask": {1: dim("total", min=1, max=8192)},
                            "past_key_values": {2: dim("past", min=0, max=8192)}},
            custom_translation_table=onnx_translation_table("decomposed"))
        convert_to_ir(onnx_path, xml, "f32", log)
    explicit = compile_ir(xml, "f32", props).model
    request = explicit.create_infer_request()
    for context in CONTEXTS:
        past = rng.standard_normal((layers, 1, context, width), dtype=np.float32)
        feeds = {"input_ids": np.array([[5]]), "position_ids": np.array([[context]]),
                 "attention_mask": np.ones((1, context + 1), dtype=np.int64),
                 "past_key_values": past}

        def explicit_step(feeds=feeds, request=request) -> None:
            request.infer(feeds)
            np.array(request.get_tensor("present_key_values").data)  # the next step's past

        results["whole_cache_in_out"][str(context)] = timed(explicit_step)
        log(f"kv whole cache in/out context {context}: "
            f"{results['whole_cache_in_out'][str(context)]:.2f} ms")
    del explicit

    core = ov.Core()
    from numaov.custom_ops import add_extension

    add_extension(core)
    stateful = core.read_model(str(xml))
    apply_make_stateful_transformation(stateful, {"past_key_values": "present_key_values"})
    compiled = compile_ir(stateful, "f32", props).model
    request = compiled.create_infer_request()
    for context in CONTEXTS:
        past = rng.standard_normal((layers, 1, context, width), dtype=np.float32)
        feeds = {"input_ids": np.array([[5]]), "position_ids": np.array([[context]]),
                 "attention_mask": np.ones((1, context + 1), dtype=np.int64)}

        def stateful_step(feeds=feeds, request=request, past=past) -> None:
            request.query_state()[0].state = ov.Tensor(past)  # not timed below: reset
            request.infer(feeds)

        def reset(request=request, past=past) -> None:
            request.query_state()[0].state = ov.Tensor(past)

        reset_ms = timed(reset)
        results["stateful"][str(context)] = timed(stateful_step) - reset_ms
        log(f"kv stateful context {context}: {results['stateful'][str(context)]:.2f} ms")
    del compiled

    # 3. OpenVINO's paged-attention transformation on the same graph
    try:
        from openvino._offline_transformations import paged_attention_transformation

        paged = core.read_model(str(xml))
        # it rewrites a stateful graph's ReadValue -> Concat -> SDPA -> Assign cache pattern
        apply_make_stateful_transformation(paged, {"past_key_values": "present_key_values"})
        paged_attention_transformation(paged)
        names = sorted({op.get_type_name() for op in paged.get_ops()})
        results["paged_attention"] = {
            "applied": "PagedAttentionExtension" in names,
            "note": "PagedAttentionExtension nodes: "
                    f"{sum(op.get_type_name() == 'PagedAttentionExtension' for op in paged.get_ops())}",
        }
    except Exception as exc:  # noqa: BLE001 - recorded: what OpenVINO said
        results["paged_attention"] = {"applied": False, "note": f"{type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0][:300]}"}
    log(f"kv paged attention: {results['paged_attention']}")
    return results


# -- where a dp=2 step goes: OpenVINO's per-node profile on every rank -----------------------


def _profile_rank(context: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Worker: compile this rank's IR with PERF_COUNT, run decode steps of ``job['rows']``
    sequences at ``job['context']`` cached tokens, sum OpenVINO's per-node times by type."""
    import openvino as ov

    from numaov.runtime.manifest_reader import read_manifest

    manifest = read_manifest(job["model_dir"], expected_kind="deepseek")
    config = {**context.openvino_config(), "PERF_COUNT": "YES"}
    compiled = manifest.compile_rank(context.rank, config)
    request = compiled.create_infer_request()
    c = LM_BENCH_CONFIG
    rows, past = job["rows"][context.rank], job["context"]
    pool = np.random.default_rng(context.rank).standard_normal(
        (c.num_hidden_layers, max(rows, 1) * past + 1, c.kv_cache_dim), dtype=np.float32)
    request.set_tensor("kv_cache", ov.Tensor(pool, shared_memory=True))
    feeds = {"input_ids": np.full((rows, 1), 5), "position_ids": np.full((rows, 1), past),
             "attention_mask": np.ones((rows, past + 1), dtype=np.int64),
             "past_slots": np.arange(rows * past, dtype=np.int64).reshape(rows, past)}
    for _ in range(3):
        request.infer(feeds)
    by_type: dict[str, float] = {}
    walls = []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        request.infer(feeds)
        walls.append(time.perf_counter() - start)
        for info in request.get_profiling_info():
            key = info.node_type
            by_type[key] = by_type.get(key, 0.0) + info.real_time.total_seconds()
    steps = job["steps"]
    return {"rank": context.rank, "threads": context.binding.threads,
            "step_ms_median": 1e3 * statistics.median(walls),
            "by_type_ms": {k: round(1e3 * v / steps, 3) for k, v in
                           sorted(by_type.items(), key=lambda kv: -kv[1]) if v / steps > 2e-5}}


def profile_dp(dirs: dict[int, Path]) -> dict[str, Any]:
    """Per-node profile of a decode step (context 128) at batch 1 and 8, dp=1 and dp=2."""
    from numaov.runtime.placement.binding import plan_for_ranks
    from numaov.runtime.placement.workers import run_on_ranks

    out: dict[str, Any] = {}
    for batch in (1, 8):
        for dp in (1, 2):
            os.environ["NUMAOV_CPU_BIND"] = "0|1" if dp == 2 else "0-1"
            plan = plan_for_ranks(dp)
            rows = [batch] if dp == 1 else [(batch + 1) // 2, batch // 2]
            job = {"model_dir": str(dirs[dp]), "rows": rows, "context": 128, "steps": 20}
            per_rank = run_on_ranks(plan, _profile_rank, [job] * dp,
                                    group="deepseek" if dp > 1 else None, timeout_s=1800)
            out[f"dp{dp}_batch{batch}"] = per_rank
            log(f"profile dp={dp} batch {batch}: " + "; ".join(
                f"rank {r['rank']} {r['step_ms_median']:.2f} ms" for r in per_rank))
    return out


# -- optimum-intel, in its own venv -----------------------------------------------------------

_OPTIMUM = textwrap.dedent('''
    import json, statistics, sys, time
    from pathlib import Path
    import numpy as np, torch
    import transformers
    from optimum.exporters.openvino import model_configs
    from optimum.exporters.openvino.model_patcher import (
        OVDecoderModelPatcher, register_ov_batched_mm)
    from optimum.intel import OVModelForCausalLM
    # optimum-intel 2.2 exports deepseek_v2 only for DeepSeek's remote modeling code
    # (transformers <= 4.53.3, whose patcher swaps in that code's attention). This
    # transformers has DeepseekV2 built in: lift the cap and patch it as optimum-intel patches
    # its other transformers-5 MoE models (gpt-oss): the plain decoder patcher with the experts
    # as OpenVINO-friendly batched matmuls (data-independent under tracing).
    class DeepseekV2Patcher(OVDecoderModelPatcher):
        def __enter__(self):
            super().__enter__()
            register_ov_batched_mm(self)
            return self
    model_configs.DeepseekOpenVINOConfig.MAX_TRANSFORMERS_VERSION = transformers.__version__
    model_configs.DeepseekOpenVINOConfig._MODEL_PATCHER = DeepseekV2Patcher
    checkpoint, out_dir, request = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    t = time.perf_counter()
    if not (out_dir / "openvino_model.xml").is_file():
        # int8 / int4: NNCF weight-only compression of every matmul (symmetric, as numaov's
        # formats), int4 at numaov's group size; f32 / bf16: the weights as exported.
        from optimum.intel import OVWeightQuantizationConfig
        bits = {"int8": 8, "int4": 4}.get(request["weights"])
        quantization = (None if bits is None else OVWeightQuantizationConfig(
            bits=bits, sym=True, **({"group_size": request["group_size"], "ratio": 1.0}
                                    if bits == 4 else {})))
        model = OVModelForCausalLM.from_pretrained(
            checkpoint, export=True, stateful=True, compile=False, ov_config=request["config"],
            load_in_8bit=False if quantization is None else None,
            quantization_config=quantization)
        model.save_pretrained(out_dir)
    model = OVModelForCausalLM.from_pretrained(out_dir, ov_config=request["config"])
    export_s = time.perf_counter() - t
    result = {"export_and_load_s": export_s, "batches": {}}

    class Timer:
        def __init__(self): self.marks = []
        def __call__(self, *args, **kwargs):
            self.marks.append(time.perf_counter())
            return False

    from transformers import StoppingCriteriaList
    print("READY " + json.dumps(result), flush=True)
    for line in sys.stdin:  # one batch of prompts per line, one answer line each
        prompts = json.loads(line)
        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)
        model.generate(input_ids=ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
        timer = Timer()
        out = model.generate(input_ids=ids, attention_mask=mask,
                             max_new_tokens=request["new_tokens"], min_new_tokens=request["new_tokens"],
                             do_sample=False, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([timer]))
        steps = np.diff(timer.marks)  # one mark per generated token, after it
        print("RESULT " + json.dumps({
            "decode_tokens_per_s": len(prompts) * len(steps) / float(steps.sum()),
            "decode_step_ms_median": 1e3 * float(np.median(steps)),
            "tokens": out[:, ids.shape[1]:].tolist(),
        }), flush=True)
''')


class OptimumDecoder:
    """optimum-intel in its own venv, one worker process kept across the rounds: it exports
    (once; cached in WORK) and compiles at start, then decodes one batch per request line."""

    name = "optimum-intel"

    def __init__(self, checkpoint: Path, precision: str, weights: str,
                 group_size: int | None) -> None:
        weights = OPTIMUM_WEIGHTS.get((weights, precision), weights)
        self.weights = weights
        if not OPTIMUM_PYTHON.is_file():
            raise SystemExit(f"no optimum-intel venv at {OPTIMUM_PYTHON}; run "
                             "benchmarks/optimum_venv.sh")
        request = {
            "new_tokens": NEW_TOKENS, "weights": weights, "group_size": group_size or 32,
            "config": {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": "2",
                       "NUM_STREAMS": "1", "PERFORMANCE_HINT": "LATENCY"},
        }
        log(f"optimum-intel: {weights} weights, {precision} inference")
        self._proc = subprocess.Popen(
            [str(OPTIMUM_PYTHON), "-c", _OPTIMUM, str(checkpoint),
             str(WORK / f"optimum_{weights}_{precision}"), json.dumps(request)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started = self._answer("READY ")

    def _answer(self, prefix: str) -> dict[str, Any]:
        for line in self._proc.stdout:
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
        raise SystemExit(f"the optimum-intel worker exited ({self._proc.wait()}); its "
                         "stderr is above")

    def decode(self, batch: int) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps(prompts(batch)) + "\n")
        self._proc.stdin.flush()
        return self._answer("RESULT ")

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=120)


def decode_rounds(decoders: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Every system at every batch once per round, the systems' order rotating each round
    (the machine's speed drifts within minutes); medians and ranges over the rounds."""
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {str(b): [] for b in BATCHES} for name in decoders}
    names = list(decoders)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for batch in BATCHES:
            for name in order:
                row = decoders[name].decode(batch)
                samples[name][str(batch)].append(row)
                log(f"round {r + 1}/{rounds} batch {batch:>2} {name}: "
                    f"{row['decode_tokens_per_s']:.1f} tok/s")
    summary: dict[str, Any] = {}
    for name, per_batch in samples.items():
        summary[name] = {}
        for batch, rows in per_batch.items():
            rates = [row["decode_tokens_per_s"] for row in rows]
            summary[name][batch] = {
                "decode_tokens_per_s_median": statistics.median(rates),
                "decode_tokens_per_s_range": [min(rates), max(rates)],
                "decode_step_ms_median": statistics.median(
                    row["decode_step_ms_median"] for row in rows),
                "tokens": rows[0]["tokens"],
            }
    return summary


# -- the run ----------------------------------------------------------------------------------


def main() -> None:
    global BATCHES
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="decode,context,kv")
    parser.add_argument("--precision", default="f32", choices=("f32", "bf16"),
                        help="inference precision of both systems")
    parser.add_argument("--weights", choices=("f32", "bf16", "int8", "int4", "fp8"),
                        help="weight format of both systems (default: the precision's; fp8: "
                             "optimum-intel at OPTIMUM_WEIGHTS)")
    parser.add_argument("--also", default="",
                        help="other PRECISION:WEIGHTS formats timed in the same decode rounds "
                             "(numaov dp=1, and optimum-intel once per format), e.g. "
                             "bf16:bf16,bf16:fp8")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="decode batch sizes (default 1,8,32)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="decode rounds (every system at every batch once per round)")
    args = parser.parse_args()
    args.weights = args.weights or args.precision
    BATCHES = tuple(int(b) for b in args.batches.split(","))
    also = [tuple(item.split(":")) for item in filter(None, args.also.split(","))]
    sections = set(args.sections.split(","))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)), "load_start": uptime(),
        "precision": args.precision, "weights": args.weights, "rounds": args.rounds,
        "batches": list(BATCHES), "also": [f"{p}:{w}" for p, w in also],
        "command": " ".join(["python", "benchmarks/lm_engine.py", *sys.argv[1:]]),
    }
    log(f"load at start: {results['load_start']}")
    checkpoint = build_checkpoint()
    dirs = {dp: numaov_export(checkpoint, dp, args.precision, args.weights) for dp in (1, 2)}
    inference = "f32" if args.precision == "f32" else "bf16"
    if "decode" in sections:
        group_size = json.loads((dirs[1] / "manifest.json").read_text()).get(
            "weights_group_size")
        decoders = {"optimum": OptimumDecoder(checkpoint, inference, args.weights, group_size)}
        results["optimum_export_and_load_s"] = decoders["optimum"].started["export_and_load_s"]
        results["optimum_weights"] = decoders["optimum"].weights
        optimum_formats = {(inference, decoders["optimum"].weights): "optimum"}
        for precision, weights in also:
            extra_inference = "f32" if precision == "f32" else "bf16"
            key = (extra_inference, OPTIMUM_WEIGHTS.get((weights, extra_inference), weights))
            if key not in optimum_formats:
                name = f"optimum_{key[0]}_{key[1]}"
                optimum_formats[key] = name
                decoders[name] = OptimumDecoder(checkpoint, extra_inference, weights, None)
                results[f"{name}_export_and_load_s"] = decoders[name].started[
                    "export_and_load_s"]
        decoders["numaov_dp1"] = EngineDecoder(dirs[1], 1)
        decoders["numaov_dp2"] = EngineDecoder(dirs[2], 2)
        for precision, weights in also:
            decoders[f"numaov_dp1_{precision}_{weights}"] = EngineDecoder(
                numaov_export(checkpoint, 1, precision, weights), 1)
        try:
            results.update(decode_rounds(decoders, args.rounds))
        finally:
            for decoder in decoders.values():
                decoder.close()
        results["optimum_runs"] = {name: f"{w} weights, {p} inference"
                                   for (p, w), name in optimum_formats.items()}
        ratios = {}
        for b in map(str, BATCHES):
            opt, one, two = (results[k][b] for k in ("optimum", "numaov_dp1", "numaov_dp2"))
            rate = "decode_tokens_per_s_median"
            ratios[b] = {
                "dp1_vs_optimum": one[rate] / opt[rate],
                "dp2_vs_dp1": two[rate] / one[rate],
                "dp1_same_tokens_as_optimum": one["tokens"] == opt["tokens"],
                "dp2_same_tokens_as_dp1": two["tokens"] == one["tokens"],
            }
            for precision, weights in also:
                other = results[f"numaov_dp1_{precision}_{weights}"][b]
                ratios[b][f"dp1_vs_dp1_{precision}_{weights}"] = one[rate] / other[rate]
                ratios[b][f"dp1_{precision}_{weights}_vs_optimum"] = other[rate] / results[
                    optimum_formats[("f32" if precision == "f32" else "bf16",
                                     OPTIMUM_WEIGHTS.get((weights, "f32" if precision == "f32"
                                                          else "bf16"), weights))]][b][rate]
            log(f"batch {b}: {ratios[b]}")
        results["ratios"] = ratios
    if "context" in sections:
        results["context_ms"] = {f"dp{dp}": engine_context(dirs[dp], dp) for dp in (1, 2)}
    if "profile" in sections:
        results["profile"] = profile_dp(dirs)
    if "kv" in sections:
        results["kv_candidates_ms"] = kv_candidates(checkpoint, dirs[1])
    results["load_end"] = uptime()
    log(f"load at end: {results['load_end']}")
    out = Path(str(OUT).format(precision=args.precision, weights=args.weights))
    out.parent.mkdir(parents=True, exist_ok=True)
    for section in list(results):
        if section.startswith(("optimum", "numaov_dp")) and isinstance(results[section], dict):
            for row in results[section].values():
                if isinstance(row, dict):
                    row.pop("tokens", None)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

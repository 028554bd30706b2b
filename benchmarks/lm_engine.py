"""The LM engine against optimum-intel, side by side in one run, on one seeded checkpoint per
model family (``--family``; ``benchmarks/lm_checkpoints.py`` builds them):

- ``deepseek_v2`` (default): a DeepSeek-V2-shaped checkpoint (hidden 1024, 4 layers: one dense,
  three MoE with 16 routed + 2 shared experts, top-6, kv_lora_rank 256, q_lora_rank 384, vocab
  16384; 537 MB in f32), numaov's own ``DeepseekV2``;
- ``deepseek_v3``: DeepSeek-V3's shape cut to 1.51 GB in bf16 (hidden 2048, V3's MLA with 16
  heads, 4 layers of which 1 dense, 64 routed experts of 512 in 8 groups, top-8 of 4 groups, 1
  shared, sigmoid scores with ``e_score_correction_bias``, vocab 12,288), transformers'
  ``DeepseekV3ForCausalLM``;
- ``qwen_moe``: Qwen3-30B-A3B's shape cut to 1.51 GB in bf16 (hidden 2048, 32 / 4 heads of
  128, 128 experts of 768, top-8, 1 layer, vocab 32,768), transformers' ``Qwen3MoeForCausalLM``.

Each is exported by numaov (dp=1 and dp=2) and by optimum-intel (``OVModelForCausalLM``,
stateful), and both run the same seeded prompts:

- ``decode``: decode tokens/s at 1, 8 and 32 concurrent requests (prompt 32 tokens, 64 greedy
  tokens each (``--new-tokens``), end-of-sequence ignored; each round its own prompts, so no
  prefix is cached), numaov dp=1 (both cores to one rank), numaov dp=2
  (``NUMAOV_CPU_BIND="0|1"``) and optimum-intel (both cores), each kept running across
  ``--rounds`` alternating rounds (medians and ranges), in the ``--weights`` format on both
  sides (int8 / int4: numaov's ``--weights``, optimum-intel's NNCF weight compression at the
  same symmetry and group size), and whether the greedy tokens are the same as optimum-intel's.
  fp8 (numaov's E4M3 experts with 128 x 128 block scales, quantized from the checkpoint per
  block; weight-only, widened in the kernel): optimum-intel has no fp8 weight-only
  format, so its side runs the closest: int8 weights (NNCF ``INT8_SYM``, one byte per weight
  as fp8, computing in f32) at f32 precision, bf16 weights at bf16 (``OPTIMUM_WEIGHTS``).
  ``--released-fp8`` (deepseek_v3): numaov's fp8 exports read the checkpoint rewritten in
  DeepSeek's released FP8 layout (``lm_checkpoints.released_fp8``: every decoder linear weight
  in 128 x 128 blocks, as V3 / R1 ship), as a V3 user's export does; with ``--fp8-dense`` its
  attention and MLP projections stay fp8 too (numaov's ``DenseLinear``); the exports are kept
  apart (``..._fp8_released[_dense]``).
  ``--also PRECISION:WEIGHTS,...`` adds, to the same alternating rounds, a numaov dp=1 engine
  per other format (and optimum-intel at that format, once per format it runs), so e.g. fp8
  and bf16 decode are timed side by side (``ratios`` then gives dp=1's tokens/s against each).
  optimum-intel's runtime graph is recorded (its CPU plugin's layer types; the routed experts'
  kernels and their precision);
- ``prefill``: time to first token and prefill tokens/s of one 512-token prompt
  (``PREFILL_LEN``) at a time, every system of ``decode`` once per round in rotating order, a
  fresh prompt each round (numaov: the engine's chunked prefill, ``DEFAULT_PREFILL_CHUNK``
  tokens a step; optimum-intel: ``generate`` of one token);
- ``greedy``: whether numaov's f32 export (dp=1) decodes the same 16 greedy tokens as
  transformers' eager f32 model, for 2 prompts of 32 tokens (not deepseek_v2: its checkpoint
  is numaov's own);
- ``context``: time per decode step of one request at 128, 1,024 and 4,096 cached tokens;
- ``kv``: the KV-cache candidates on the family's cache (MLA entries or GQA keys and values;
  dp=1, one step graph each, at the run's precision): numaov's pool (``kv_cache`` in, new
  entries out), the same pool at 8x the capacity (a copy in would show), the whole past in and
  the whole present out (the engine before the pool), OpenVINO's stateful transformation of
  that graph, and whether OpenVINO's paged-attention transformation applies to numaov's pooled
  step graph and to the stateful graph (with its node counts or OpenVINO's error); then, where
  it applies, on optimum-intel's stateful graph of the same checkpoint (its SDPA nodes, as
  openvino.genai runs it): that graph's decode step as optimum-intel runs it and after the
  transformation (``_OPTIMUM_PAGED``);
- ``profile``: OpenVINO's per-node-type time of a decode step (``PERF_COUNT``) at 1 and 8
  requests and 128 cached tokens, numaov dp=1 and dp=2 per rank, and optimum-intel's graph
  (``_OPTIMUM_PROFILE``);
- ``roofline``: numaov dp=1's decode step of one request (128 cached tokens, the profile's
  per-node times) against the read bandwidth measured in the same run (``roofline.py``'s
  probe): the bytes a token reads (every IR constant but the token embedding, of which one
  row, and the top-k routed experts of each MoE layer as the store holds them) over the step
  time, and the same split into the routed experts (their ``MoeExperts`` nodes' time) and the
  rest (the other weights over the rest of the step). With ``decode`` in the same run, each
  batch-1 decode of numaov dp=1 and of optimum-intel also gets a read sample just before it,
  and both systems' tokens/s times the bytes a token reads are given as shares of it
  (``batch1_read_shares``).

optimum-intel runs in its own venv (``benchmarks/optimum_venv.sh``), never in numaov's; its
exports of deepseek_v2 / deepseek_v3 need its transformers cap lifted in its process (see
``_OPTIMUM``). The figures go to ``benchmarks/out/lm_engine_<precision>_<weights>.json``
(deepseek_v2) or ``lm_engine_<family>_<precision>_<weights>.json``; ``benchmarks/RESULTS.md``
records them.
Run on a quiet machine: ``uptime`` is printed at the start and the end.

    .venv/bin/python benchmarks/lm_engine.py [--family deepseek_v2|deepseek_v3|qwen_moe]
        [--sections decode,prefill,greedy,context,kv,profile,roofline] [--precision f32]
        [--weights f32|bf16|int8|int4|fp8] [--rounds 3] [--also bf16:bf16,bf16:fp8]
        [--released-fp8 [--fp8-dense]]
        [--batches 1,8,32] [--new-tokens 64]

(default sections: decode,context,kv)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import lm_checkpoints  # benchmarks/lm_checkpoints.py, beside this file
import numpy as np
import torch
from machine import cpu_model  # benchmarks/machine.py, beside this file

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "lm_engine_{precision}_{weights}.json"
OUT_FAMILY = HERE / "out" / "lm_engine_{family}_{precision}_{weights}.json"
# deepseek_v2's exports where they were before --family; the other families' under it
WORK_ROOT = HERE / "out" / "lm_engine"
WORK = WORK_ROOT
FAMILY = "deepseek_v2"
OPTIMUM_PYTHON = HERE / ".optimum-venv" / "bin" / "python"
SEED = 0
PROMPT_LEN = 32
NEW_TOKENS = 64
BATCHES = (1, 8, 32)
#: --released-fp8: fp8 exports read DeepSeek's released FP8 layout of the checkpoint;
#: --fp8-dense: and keep its projections fp8 (export_lm's fp8_dense)
RELEASED_FP8 = False
FP8_DENSE = False
PREFILL_LEN = 512
GREEDY_PROMPTS = 2
GREEDY_TOKENS = 16
# what optimum-intel runs for a numaov format it has no equal of, per inference precision
OPTIMUM_WEIGHTS = {("fp8", "f32"): "int8", ("fp8", "bf16"): "bf16"}
CONTEXTS = (128, 1024, 4096)
CONTEXT_STEPS = 16


def log(message: str) -> None:
    print(f"[lm_engine] {message}", file=sys.stderr, flush=True)


def uptime() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def prompts(count: int, length: int = PROMPT_LEN, seed: int = SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # ids from 2: 0 is the pad id, 1 the end-of-sequence id
    return rng.integers(2, lm_checkpoints.vocab_size(FAMILY), size=(count, length)).tolist()


def use_family(family: str) -> None:
    """Point the module's paths and prompts at ``family``."""
    global FAMILY, WORK
    FAMILY = family
    WORK = WORK_ROOT if family == "deepseek_v2" else WORK_ROOT / family


def random_pool(cache: Any, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """A KV-cache pool of ``tokens`` slots for an export's ``CacheLayout`` (its layout and
    dtype), filled with normal values."""
    from numaov.arrays import NUMPY_DTYPES

    return rng.standard_normal((cache.layers, tokens, cache.width), dtype=np.float32
                               ).astype(NUMPY_DTYPES[cache.dtype])


# -- the checkpoint and the exports -----------------------------------------------------------


def build_checkpoint() -> Path:
    return lm_checkpoints.build(FAMILY)


def numaov_export(checkpoint: Path, dp: int, precision: str, weights: str) -> Path:
    from numaov.exporter.lm_export import export_lm

    released = weights == "fp8" and RELEASED_FP8
    if released:  # DeepSeek's FP8 release of the same weights
        checkpoint = lm_checkpoints.released_fp8(checkpoint)
    dense = released and FP8_DENSE
    out = WORK / (f"numaov_dp{dp}_{precision}_{weights}{'_released' if released else ''}"
                  f"{'_dense' if dense else ''}")
    if (out / "manifest.json").is_file():
        return out
    log(f"numaov export dp={dp} {precision}, {weights} weights")
    os.environ["NUMAOV_CPU_BIND"] = "0|1" if dp == 2 else "0-1"
    export_lm(checkpoint, out, dp=dp, precision=precision, weights=weights, progress=log,
              force=True, fp8_dense=dense)
    return out


# -- numaov: the engine -----------------------------------------------------------------------


class EngineDecoder:
    """One numaov engine kept running across the rounds (its workers load and compile once)."""

    def __init__(self, model_dir: Path, dp: int) -> None:
        from numaov.runtime.lm.engine import LMEngine, SamplingParams

        os.environ["NUMAOV_CPU_BIND"] = "0|1" if dp == 2 else "0-1"
        self.name = f"numaov dp={dp}"
        self._params = SamplingParams(NEW_TOKENS, ignore_eos=True)
        self._engine = LMEngine.start(model_dir, "openvino", cache_tokens=max(
            max(BATCHES) * 128, PREFILL_LEN + 64))
        self.name = f"numaov dp={dp} ({model_dir.name})"
        self._engine.generate(prompts(2), SamplingParams(4, ignore_eos=True))  # warm-up

    def decode(self, batch: int, seed: int = SEED) -> dict[str, Any]:
        """Decode tokens/s of ``batch`` requests submitted at once, timed from the first step
        after every prompt's prefill to the last token."""
        engine = self._engine
        before = len(engine.step_seconds)
        done = engine.generate(prompts(batch, seed=seed), self._params)
        steps = engine.step_seconds[before:]
        decode = steps[1:]  # step 0 holds every prefill (batch * 32 tokens < one chunk per rank)
        return {"decode_tokens_per_s": batch * len(decode) / sum(decode),
                "decode_step_ms_median": 1e3 * statistics.median(decode),
                "prefill_ms": 1e3 * steps[0], "steps": len(steps),
                "tokens": [c.tokens for c in done]}

    def prefill(self, prompt: list[int]) -> dict[str, Any]:
        """Time to the first token of one prompt (submitted alone), and its prompt tokens/s."""
        from numaov.runtime.lm.engine import SamplingParams

        engine = self._engine
        before = len(engine.step_seconds)
        start = time.perf_counter()
        done = engine.generate([prompt], SamplingParams(1, ignore_eos=True))
        ttft = time.perf_counter() - start
        return {"ttft_ms": 1e3 * ttft, "prefill_tokens_per_s": len(prompt) / ttft,
                "steps_ms": [1e3 * s for s in engine.step_seconds[before:]],
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


# -- greedy tokens against transformers ------------------------------------------------------


def greedy_check(checkpoint: Path) -> dict[str, Any]:
    """GREEDY_TOKENS greedy tokens of GREEDY_PROMPTS prompts: transformers' eager model at f32
    (one prompt at a time, its own cache) against numaov's f32 export at dp=1 (one batch)."""
    from transformers import AutoModelForCausalLM

    from numaov.runtime.lm.engine import LMEngine, SamplingParams

    batch = prompts(GREEDY_PROMPTS)
    log("greedy: transformers eager f32")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    reference = []
    with torch.no_grad():
        for prompt in batch:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            reference.append(out[0, len(prompt):].tolist())
    del model
    directory = numaov_export(checkpoint, 1, "f32", "f32")
    os.environ["NUMAOV_CPU_BIND"] = "0-1"
    with LMEngine.start(directory, "openvino", cache_tokens=1024) as engine:
        numaov = [c.tokens for c in engine.generate(batch, SamplingParams(
            GREEDY_TOKENS, ignore_eos=True))]
    equal = sum(a == b for ra, rb in zip(reference, numaov, strict=True)
                for a, b in zip(ra, rb, strict=True))
    first = [next((i for i, (a, b) in enumerate(zip(ra, rb, strict=True)) if a != b), None)
             for ra, rb in zip(reference, numaov, strict=True)]
    result = {"prompts": len(batch), "prompt_tokens": PROMPT_LEN, "new_tokens": GREEDY_TOKENS,
              "same_tokens": reference == numaov, "positions_equal": equal,
              "positions": len(batch) * GREEDY_TOKENS, "first_difference": first,
              "transformers": reference, "numaov_f32": numaov}
    log(f"greedy: numaov f32 equals transformers: {result['same_tokens']} "
        f"({equal} of {result['positions']} positions)")
    return result


# -- the KV-cache candidates ------------------------------------------------------------------


def timed(run: Any, reps: int = 10) -> float:
    """Median milliseconds of ``run()`` over ``reps`` calls, after one warm-up call."""
    run()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds)


def kv_candidates(checkpoint: Path, numaov_dir: Path, precision: str) -> dict[str, Any]:
    """One decode step of one sequence per candidate at each context, dp=1, 2 threads, at
    inference ``precision`` (the explicit-cache graph's weights stored at it too)."""
    import openvino as ov
    from openvino._offline_transformations import apply_make_stateful_transformation

    from numaov.arrays import from_openvino, to_openvino
    from numaov.custom_ops import compile_ir
    from numaov.exporter.openvino_convert import convert_to_ir
    from numaov.models.families import family_for_checkpoint
    from numaov.runtime.manifest_reader import read_manifest

    cache = read_manifest(numaov_dir).record.cache
    layers, width = cache.layers, cache.width
    props = {"INFERENCE_NUM_THREADS": 2}
    rng = np.random.default_rng(SEED)
    results: dict[str, Any] = {"pool": {}, "pool_8x_capacity": {}, "whole_cache_in_out": {},
                               "stateful": {}, "paged_attention": None,
                               "paged_attention_pooled_graph": None}

    # 1. numaov's pool, bound once over shared memory
    compiled = compile_ir(numaov_dir / "rank_0" / "model.xml", precision, props).model
    for key, scale in (("pool", 1), ("pool_8x_capacity", 8)):
        pool = random_pool(cache, scale * (max(CONTEXTS) + 8), rng)
        request = compiled.create_infer_request()
        request.set_tensor("kv_cache", to_openvino(pool))
        for context in CONTEXTS:
            feeds = {"input_ids": np.array([[5]]), "position_ids": np.array([[context]]),
                     "attention_mask": np.ones((1, context + 1), dtype=np.int64),
                     "past_slots": np.arange(context, dtype=np.int64)[None]}

            def step(feeds=feeds, request=request, pool=pool, context=context) -> None:
                request.infer(feeds)
                pool[:, context] = from_openvino(request.get_tensor("new_key_values"))[:, 0, 0]

            results[key][str(context)] = timed(step)
            log(f"kv {key} context {context}: {results[key][str(context)]:.2f} ms")
    del compiled

    # 2. the whole past in, the whole present out (CausalLM.step), and its stateful form
    xml = WORK / ("explicit_cache" if precision == "f32" else f"explicit_cache_{precision}") / (
        "model.xml")
    if not xml.is_file():
        model = family_for_checkpoint(checkpoint).load(checkpoint, torch.float32)

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
        convert_to_ir(onnx_path, xml, precision, log)
        del model
    explicit = compile_ir(xml, precision, props).model
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
    compiled = compile_ir(stateful, precision, props).model
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

    # 3. OpenVINO's paged-attention transformation on the same graph (made stateful: it
    # rewrites a stateful graph's ReadValue -> Concat -> SDPA -> Assign cache pattern), and on
    # numaov's pooled step graph as exported
    def paged(model: Any, make_stateful: bool) -> dict[str, Any]:
        from openvino._offline_transformations import paged_attention_transformation

        def count(name: str) -> int:
            return sum(op.get_type_name() == name for op in model.get_ops())

        before = {"ScaledDotProductAttention": count("ScaledDotProductAttention"),
                  "ReadValue": 0, "Softmax": count("Softmax")}
        try:
            if make_stateful:
                apply_make_stateful_transformation(
                    model, {"past_key_values": "present_key_values"})
            before["ReadValue"] = count("ReadValue")
            paged_attention_transformation(model)
        except Exception as exc:  # noqa: BLE001 - recorded: what OpenVINO said
            return {"applied": False, "nodes_before": before,
                    "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        nodes = count("PagedAttentionExtension")
        return {"applied": nodes > 0, "nodes_before": before,
                "note": f"PagedAttentionExtension nodes: {nodes}"}

    results["paged_attention"] = paged(core.read_model(str(xml)), True)
    log(f"kv paged attention (stateful graph): {results['paged_attention']}")
    results["paged_attention_pooled_graph"] = paged(
        core.read_model(str(numaov_dir / "rank_0" / "model.xml")), False)
    log(f"kv paged attention (numaov's pooled graph): {results['paged_attention_pooled_graph']}")
    return results


# -- where a dp=2 step goes: OpenVINO's per-node profile on every rank -----------------------


def _profile_rank(context: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Worker: compile this rank's IR with PERF_COUNT, run decode steps of ``job['rows']``
    sequences at ``job['context']`` cached tokens, sum OpenVINO's per-node times by type."""
    from numaov.arrays import to_openvino
    from numaov.runtime.manifest_reader import read_manifest

    manifest = read_manifest(job["model_dir"])
    config = {**context.openvino_config(), "PERF_COUNT": "YES"}
    compiled = manifest.compile_rank(context.rank, config)
    request = compiled.create_infer_request()
    rows, past = job["rows"][context.rank], job["context"]
    pool = random_pool(manifest.record.cache, max(rows, 1) * past + 1,
                       np.random.default_rng(context.rank))
    request.set_tensor("kv_cache", to_openvino(pool))
    feeds = {"input_ids": np.full((rows, 1), 5), "position_ids": np.full((rows, 1), past),
             "attention_mask": np.ones((rows, past + 1), dtype=np.int64),
             "past_slots": np.arange(rows * past, dtype=np.int64).reshape(rows, past)}
    for _ in range(3):
        request.infer(feeds)
    moe_nodes = set(moe_node_names(manifest.rank(context.rank).ir_xml))
    by_type: dict[str, float] = {}
    moe_seconds = 0.0
    walls = []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        request.infer(feeds)
        walls.append(time.perf_counter() - start)
        for info in request.get_profiling_info():
            key = info.node_type
            by_type[key] = by_type.get(key, 0.0) + info.real_time.total_seconds()
            if info.node_name in moe_nodes:
                moe_seconds += info.real_time.total_seconds()
    steps = job["steps"]
    return {"rank": context.rank, "threads": context.binding.threads,
            "step_ms_median": 1e3 * statistics.median(walls),
            "moe_experts_ms": 1e3 * moe_seconds / steps,
            "by_type_ms": {k: round(1e3 * v / steps, 3) for k, v in
                           sorted(by_type.items(), key=lambda kv: -kv[1]) if v / steps > 2e-5}}


# -- the decode step against the read bandwidth -------------------------------------------------


def _ir_model(xml: Path) -> Any:
    import openvino as ov

    from numaov.native import add_extension

    core = ov.Core()
    add_extension(core)
    return core.read_model(str(xml))


def moe_node_names(xml: Path) -> list[str]:
    """The friendly names of the IR's ``MoeExperts`` nodes (as OpenVINO's profile names them)."""
    return [op.get_friendly_name() for op in _ir_model(xml).get_ops()
            if op.get_type_name() == "MoeExperts"]


# The ops between a weight's constants and its use: its decompression (NNCF's int8 / int4
# and bf16 storage).
_DECOMPRESSION = {"Convert", "Multiply", "Subtract", "Reshape", "Unsqueeze", "Squeeze"}


def _weight_constants(node: Any) -> list[Any]:
    """The constants of the weight ``node`` is (a Constant, or its decompression of
    constants); empty when ``node`` is computed from anything else."""
    if node.get_type_name() == "Constant":
        return [node]
    if node.get_type_name() not in _DECOMPRESSION:
        return []
    found = []
    for value in node.input_values():
        above = _weight_constants(value.get_node())
        if not above:
            return []
        found += above
    return found


def weights_read_per_token(model_dir: Path) -> dict[str, Any]:
    """What one decode step of one request reads from rank 0's weights: every constant of its IR
    (attention, norms, router, dense and shared MLPs, lm_head) but the token embedding, of which
    it reads one row, and the top-k routed experts of each MoE layer, in the store's format
    (weights and scales). The KV cache (a few hundred KB at 128 tokens) is left out."""
    from numaov.custom_ops.expert_store import STORE_NAME, open_store
    from numaov.runtime.manifest_reader import read_manifest

    xml = read_manifest(model_dir).rank(0).ir_xml
    model = _ir_model(xml)
    constants = sum(op.get_byte_size() for op in model.get_ops()
                    if op.get_type_name() == "Constant")
    embedding, embedding_rows = 0, 1
    for op in model.get_ops():  # the token embedding: the Gather with the largest table
        if op.get_type_name() == "Gather":
            table = _weight_constants(op.input_value(0).get_node())
            size = sum(c.get_byte_size() for c in table)
            if size > embedding:
                largest = max(table, key=lambda c: c.get_byte_size())
                embedding, embedding_rows = size, int(largest.get_output_shape(0)[0])
    store = open_store(xml.parent / STORE_NAME)
    experts = 0
    moe_layers = 0
    for op in model.get_ops():
        if op.get_type_name() == "MoeExperts":
            plan = store.layers[int(op.get_attributes()["layer"])].plan
            top_k = op.get_input_partial_shape(1)[1].get_length()
            experts += top_k * plan.expert_bytes()
            moe_layers += 1
    other = constants - embedding + embedding // embedding_rows
    return {"ir_constants_bytes": constants, "embedding_bytes": embedding,
            "moe_layers": moe_layers, "routed_experts_bytes": experts,
            "other_weights_bytes": other, "total_bytes": other + experts}


def step_roofline(model_dir: Path, rounds: int) -> dict[str, Any]:
    """The batch-1 decode step of numaov dp=1 (context 128, OpenVINO's per-node profile)
    against the read bandwidth measured in the same run (``roofline.py``'s probe, on the
    rank's cores): the whole step, the routed experts (the ``MoeExperts`` nodes' time, their
    top-k experts' bytes) and the rest (the other weights over the rest of the step)."""
    import roofline  # benchmarks/roofline.py, beside this file

    from numaov.runtime.placement.binding import plan_for_ranks
    from numaov.runtime.placement.workers import run_on_ranks

    cpus = sorted(os.sched_getaffinity(0))
    limits = roofline.measure_limits(cpus, rounds, roofline.l3_bytes())
    read = limits["limits"]["read"]["all_cores"]["median"]
    os.environ["NUMAOV_CPU_BIND"] = "0-1"
    job = {"model_dir": str(model_dir), "rows": [1], "context": 128, "steps": 20 * rounds}
    (profile,) = run_on_ranks(plan_for_ranks(1), _profile_rank, [job], timeout_s=1800)
    weights = weights_read_per_token(model_dir)
    step_s, moe_s = profile["step_ms_median"] / 1e3, profile["moe_experts_ms"] / 1e3
    parts = {"step": (weights["total_bytes"], step_s),
             "routed_experts": (weights["routed_experts_bytes"], moe_s),
             "rest": (weights["other_weights_bytes"], step_s - moe_s)}
    out: dict[str, Any] = {"read_gb_s": read, "limits": limits, "bytes": weights,
                           "profile": profile}
    for name, (nbytes, seconds) in parts.items():
        gb_s = nbytes / seconds / 1e9
        out[name] = {"ms": 1e3 * seconds, "mb": nbytes / 1e6, "gb_s": gb_s, "of_read": gb_s / read}
        log(f"roofline {name}: {nbytes / 1e6:.1f} MB in {1e3 * seconds:.2f} ms, "
            f"{gb_s:.1f} GB/s, {100 * gb_s / read:.0f}% of {read:.1f} GB/s read")
    return out


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
            group = json.loads((dirs[dp] / "manifest.json").read_text())["collective_group"]
            per_rank = run_on_ranks(plan, _profile_rank, [job] * dp,
                                    group=group if dp > 1 else None, timeout_s=1800)
            out[f"dp{dp}_batch{batch}"] = per_rank
            log(f"profile dp={dp} batch {batch}: " + "; ".join(
                f"rank {r['rank']} {r['step_ms_median']:.2f} ms" for r in per_rank))
    return out


# -- optimum-intel, in its own venv -----------------------------------------------------------

_OPTIMUM = textwrap.dedent('''
    import collections, json, statistics, sys, time
    from pathlib import Path
    import numpy as np, torch
    import transformers
    from optimum.exporters.openvino import model_configs
    from optimum.exporters.openvino.model_patcher import (
        OVDecoderModelPatcher, lfm2_moe_experts_forward, register_ov_batched_mm)
    from optimum.intel import OVModelForCausalLM
    checkpoint, out_dir, request = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    # optimum-intel 2.2 exports deepseek_v2 / deepseek_v3 only for DeepSeek's remote modeling
    # code (its DeepseekOpenVINOConfig caps transformers at 4.53.3, whose patcher swaps in
    # that code's attention; 4.53.3 has neither model built in, and the remote code is not
    # on this machine). This transformers has both built in: lift the cap and patch them as
    # optimum-intel patches its transformers-5 MoE models.
    # - deepseek_v2 (as before --family): gpt-oss's way, the experts as OpenVINO-friendly
    #   batched matmuls over every expert (data-independent under tracing);
    # - deepseek_v3: qwen3_moe's way (Qwen3MoeModelPatcher), every expert on every token as
    #   tiled batched matmuls weighted by the dense routing weights, the pattern OpenVINO's
    #   CPU plugin rewrites into gathered matmuls of the chosen experts
    #   (ConvertTiledMoeBlockToGatherMatmuls -> GatherMatmul).
    # qwen3_moe: optimum-intel's own config and patcher, nothing lifted.
    class DeepseekV2Patcher(OVDecoderModelPatcher):
        def __enter__(self):
            super().__enter__()
            register_ov_batched_mm(self)
            return self
    class DeepseekV3Patcher(OVDecoderModelPatcher):
        def __enter__(self):
            super().__enter__()
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3NaiveMoe
            self._experts_forward = DeepseekV3NaiveMoe.forward
            DeepseekV3NaiveMoe.forward = lfm2_moe_experts_forward
            return self
        def __exit__(self, *exc):
            super().__exit__(*exc)
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3NaiveMoe
            DeepseekV3NaiveMoe.forward = self._experts_forward
    patcher = {"deepseek_v2": DeepseekV2Patcher, "deepseek_v3": DeepseekV3Patcher}.get(
        request["family"])
    if patcher is not None:
        model_configs.DeepseekOpenVINOConfig.MAX_TRANSFORMERS_VERSION = transformers.__version__
        model_configs.DeepseekOpenVINOConfig._MODEL_PATCHER = patcher
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
    # what the CPU plugin runs: its layer types, and the routed experts' kernels (layer type
    # and runtime precision of the nodes named after the experts)
    layer_types, experts = collections.Counter(), collections.Counter()
    for op in model.request.get_compiled_model().get_runtime_model().get_ops():
        info = op.get_rt_info()
        kind = info["layerType"].astype(str)
        layer_types[kind] += 1
        if "experts" in op.get_friendly_name() and kind not in (
                "Const", "Reshape", "Reorder", "ShapeOf", "Input", "Output", "Concatenation"):
            experts[kind + " " + info["runtimePrecision"].astype(str)] += 1
    result = {"export_and_load_s": export_s, "runtime_layer_types": dict(layer_types),
              "experts_runtime_nodes": dict(experts)}

    class Timer:
        def __init__(self): self.marks = []
        def __call__(self, *args, **kwargs):
            self.marks.append(time.perf_counter())
            return False

    from transformers import StoppingCriteriaList
    print("READY " + json.dumps(result), flush=True)
    for line in sys.stdin:  # one request per line ({"kind", "prompts"}), one answer line each
        job = json.loads(line)
        ids = torch.tensor(job["prompts"])
        mask = torch.ones_like(ids)
        if job["kind"] == "prefill":  # one prompt, one token: time to the first token
            timer = Timer()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1,
                                 min_new_tokens=1, do_sample=False, pad_token_id=0,
                                 stopping_criteria=StoppingCriteriaList([timer]))
            ttft = timer.marks[0] - start
            print("RESULT " + json.dumps({
                "ttft_ms": 1e3 * ttft, "prefill_tokens_per_s": ids.shape[1] / ttft,
                "tokens": out[:, ids.shape[1]:].tolist()}), flush=True)
            continue
        model.generate(input_ids=ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
        timer = Timer()
        out = model.generate(input_ids=ids, attention_mask=mask,
                             max_new_tokens=request["new_tokens"], min_new_tokens=request["new_tokens"],
                             do_sample=False, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([timer]))
        steps = np.diff(timer.marks)  # one mark per generated token, after it
        print("RESULT " + json.dumps({
            "decode_tokens_per_s": len(job["prompts"]) * len(steps) / float(steps.sum()),
            "decode_step_ms_median": 1e3 * float(np.median(steps)),
            "tokens": out[:, ids.shape[1]:].tolist(),
        }), flush=True)
''')


# OpenVINO's paged attention where it applies: on optimum-intel's stateful graph (its SDPA
# nodes reading ReadValue states), as openvino.genai runs it. One sequence's decode step at
# each context: first the graph as optimum-intel runs it (the context prefilled, then decode
# steps timed), then after paged_attention_transformation, with block tables over a cache of
# PA_BLOCK-token blocks (the CPU plugin's layout: [blocks, KV heads, block, head size], at the
# inference precision).
PA_BLOCK = 32
_OPTIMUM_PAGED = textwrap.dedent('''
    import json, math, statistics, sys, time
    from pathlib import Path
    import numpy as np, openvino as ov
    from openvino._offline_transformations import paged_attention_transformation
    directory, precision, contexts, block = (Path(sys.argv[1]), sys.argv[2],
                                             json.loads(sys.argv[3]), int(sys.argv[4]))
    config = json.loads((directory / "config.json").read_text())
    xml = str(directory / "openvino_model.xml")
    core = ov.Core()
    props = {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": precision,
             "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}

    out = {"stateful": {}, "paged": {}}
    rng = np.random.default_rng(0)
    request = core.compile_model(core.read_model(xml), "CPU", props).create_infer_request()
    beam = np.zeros(1, dtype=np.int32)
    for c in contexts:
        request.reset_state()
        request.infer({"input_ids": rng.integers(2, config["vocab_size"], size=(1, c)),
                       "attention_mask": np.ones((1, c), dtype=np.int64),
                       "position_ids": np.arange(c)[None], "beam_idx": beam})
        state = {"n": c}

        def decode(state=state):
            n = state["n"]
            request.infer({"input_ids": np.array([[5]]),
                           "attention_mask": np.ones((1, n + 1), dtype=np.int64),
                           "position_ids": np.array([[n]]), "beam_idx": beam})
            state["n"] = n + 1

        out["stateful"][str(c)] = timed(decode)
    del request
    model = core.read_model(xml)
    try:
        paged_attention_transformation(model)
    except Exception as exc:
        out["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print("RESULT " + json.dumps(out), flush=True)
        sys.exit(0)
    out["paged_nodes"] = sum(op.get_type_name() == "PagedAttentionExtension"
                             for op in model.get_ops())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    key_size = (config.get("qk_nope_head_dim", 0) + config.get("qk_rope_head_dim", 0)
                or config.get("head_dim")
                or config["hidden_size"] // config["num_attention_heads"])
    value_size = config.get("v_head_dim") or key_size
    cache_type = ov.Type.bf16 if precision == "bf16" else ov.Type.f32
    caches = {}
    for parameter in model.get_parameters():
        name = parameter.get_output_tensor(0).get_any_name()
        if name.startswith(("key_cache.", "value_cache.")):
            size = key_size if name.startswith("key") else value_size
            caches[name] = [math.ceil((max(contexts) + 64) / block), heads, block, size]
            parameter.set_element_type(cache_type)
            parameter.set_partial_shape(ov.PartialShape([-1, heads, block, size]))
    model.validate_nodes_and_infer_types()
    request = core.compile_model(model, "CPU", props).create_infer_request()
    for name, shape in caches.items():
        request.set_tensor(name, ov.Tensor(cache_type, shape))
    for c in contexts:
        blocks = math.ceil((c + 1) / block)
        feeds = {"input_ids": np.array([5]), "position_ids": np.array([c]),
                 "past_lens": np.array([c], dtype=np.int32),
                 "subsequence_begins": np.array([0, 1], dtype=np.int32),
                 "block_indices_begins": np.array([0, blocks], dtype=np.int32),
                 "block_indices": np.arange(blocks, dtype=np.int32),
                 "max_context_len": np.array(c + 1, dtype=np.int32)}
        out["paged"][str(c)] = timed(lambda feeds=feeds: request.infer(feeds))
    print("RESULT " + json.dumps(out), flush=True)
''')


# optimum-intel's side of ``profile``: its graph compiled with PERF_COUNT, rows prefilled to
# 128 tokens, then decode steps timed; OpenVINO's per-node times summed by executed type.
# (OpenVINO 2026.4 reports GatherMatmul nodes' times far above the step's: 270 ms of node time
# in a 32 ms step of deepseek_v3 int8, 9 GatherMatmul nodes 15-27 ms each; read those as
# unusable, the step's wall time as the figure.)
_OPTIMUM_PROFILE = textwrap.dedent('''
    import json, statistics, sys, time
    from pathlib import Path
    import numpy as np, openvino as ov
    directory, precision = Path(sys.argv[1]), sys.argv[2]
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    compiled = ov.Core().compile_model(str(directory / "openvino_model.xml"), "CPU", {
        "INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": precision, "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY", "PERF_COUNT": "YES"})
    request = compiled.create_infer_request()
    out = {}
    for batch in (1, 8):
        request.reset_state()
        past, beam = 128, np.arange(batch, dtype=np.int32)
        request.infer({"input_ids": np.random.default_rng(0).integers(2, vocab, (batch, past)),
                       "attention_mask": np.ones((batch, past), dtype=np.int64),
                       "position_ids": np.tile(np.arange(past), (batch, 1)), "beam_idx": beam})
        by_type, walls = {}, []
        for step in range(23):
            feeds = {"input_ids": np.full((batch, 1), 5),
                     "attention_mask": np.ones((batch, past + 1), dtype=np.int64),
                     "position_ids": np.full((batch, 1), past), "beam_idx": beam}
            start = time.perf_counter()
            request.infer(feeds)
            past += 1
            if step < 3:
                continue
            walls.append(time.perf_counter() - start)
            for info in request.get_profiling_info():
                by_type[info.node_type] = (by_type.get(info.node_type, 0.0)
                                           + info.real_time.total_seconds())
        out[f"batch{batch}"] = {
            "step_ms_median": 1e3 * statistics.median(walls),
            "by_type_ms": {k: round(1e3 * v / len(walls), 3) for k, v in
                           sorted(by_type.items(), key=lambda kv: -kv[1])
                           if v / len(walls) > 2e-5}}
    print("RESULT " + json.dumps(out), flush=True)
''')


def optimum_script(script: str, precision: str, weights: str, *args: str) -> dict[str, Any]:
    """One of the scripts above in optimum-intel's venv, on the run's optimum-intel export
    (made by ``decode`` / ``prefill``); its RESULT line."""
    directory = WORK / f"optimum_{OPTIMUM_WEIGHTS.get((weights, precision), weights)}_{precision}"
    if not (directory / "openvino_model.xml").is_file():
        return {"note": f"no optimum-intel export at {directory} (run the decode section)"}
    # the scripts time with this module's timed(), handed over as source
    helpers = ("from __future__ import annotations\nimport statistics, time\n"
               + inspect.getsource(timed))
    proc = subprocess.run([str(OPTIMUM_PYTHON), "-c", helpers + script, str(directory),
                           precision, *args], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"note": f"the optimum-intel worker exited ({proc.returncode}); its stderr is above"}


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
            "family": FAMILY, "new_tokens": NEW_TOKENS, "weights": weights,
            "group_size": group_size or 32,
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

    def _ask(self, kind: str, batch: list[list[int]]) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps({"kind": kind, "prompts": batch}) + "\n")
        self._proc.stdin.flush()
        return self._answer("RESULT ")

    def decode(self, batch: int, seed: int = SEED) -> dict[str, Any]:
        return self._ask("decode", prompts(batch, seed=seed))

    def prefill(self, prompt: list[int]) -> dict[str, Any]:
        return self._ask("prefill", [prompt])

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=120)


def decode_rounds(decoders: dict[str, Any], rounds: int, reads: Any = None) -> dict[str, Any]:
    """Every system at every batch once per round, the systems' order rotating each round
    (the machine's speed drifts within minutes); medians and ranges over the rounds. Round r
    decodes prompts of seed ``SEED + r`` on every system (a prompt cached by an earlier round
    would move dp=2's requests to the rank holding it); tokens are compared on round 1's.
    ``reads`` (a ``roofline.ReadSampler``): a read sample just before each batch-1 decode, in
    its row as ``read_gb_s``."""
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {str(b): [] for b in BATCHES} for name in decoders}
    names = list(decoders)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for batch in BATCHES:
            for name in order:
                read = reads.sample() if reads is not None and batch == 1 else None
                row = decoders[name].decode(batch, seed=SEED + r)
                if read is not None:
                    row["read_gb_s"] = read
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
                "decode_tokens_per_s_rounds": rates,
                "decode_step_ms_median": statistics.median(
                    row["decode_step_ms_median"] for row in rows),
                "tokens": rows[0]["tokens"],
            }
            if "read_gb_s" in rows[0]:
                summary[name][batch]["read_gb_s_rounds"] = [row["read_gb_s"] for row in rows]
    return summary


def batch1_read_shares(results: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """Each system's batch-1 decode against the read bandwidth of its round: ``nbytes`` (the
    weights one token reads, `weights_read_per_token`; the same checkpoint and format on both
    sides) times tokens/s over the read sample taken just before, median over the rounds. Where
    both are near 100%, neither can be much faster without reading fewer bytes."""
    out: dict[str, Any] = {"bytes_per_token": nbytes}
    for name in ("numaov_dp1", "optimum"):
        row = results[name]["1"]
        shares = [nbytes * rate / (read * 1e9) for rate, read in
                  zip(row["decode_tokens_per_s_rounds"], row["read_gb_s_rounds"], strict=True)]
        out[name] = {"of_read_median": statistics.median(shares),
                     "of_read_range": [min(shares), max(shares)]}
        log(f"batch 1 {name}: {nbytes / 1e6:.1f} MB a token, "
            f"{100 * out[name]['of_read_median']:.0f}% of the read bandwidth "
            f"[{100 * min(shares):.0f}-{100 * max(shares):.0f}%]")
    return out


def prefill_rounds(decoders: dict[str, Any], rounds: int) -> dict[str, Any]:
    """One PREFILL_LEN-token prompt at a time on every system, once per round in rotating
    order, a fresh prompt each round (none is in a prefix cache); an untimed one first."""
    warm = prompts(1, PREFILL_LEN, seed=SEED + 1000)[0]
    for decoder in decoders.values():
        decoder.prefill(warm)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in decoders}
    names = list(decoders)
    for r in range(rounds):
        prompt = prompts(1, PREFILL_LEN, seed=SEED + 1001 + r)[0]
        for name in names[r % len(names):] + names[:r % len(names)]:
            row = decoders[name].prefill(prompt)
            samples[name].append(row)
            log(f"prefill round {r + 1}/{rounds} {name}: {row['ttft_ms']:.0f} ms to the first "
                f"token, {row['prefill_tokens_per_s']:.1f} prompt tok/s")
    summary: dict[str, Any] = {}
    for name, rows in samples.items():
        ttft = [row["ttft_ms"] for row in rows]
        rates = [row["prefill_tokens_per_s"] for row in rows]
        summary[name] = {"ttft_ms_median": statistics.median(ttft), "ttft_ms_rounds": ttft,
                         "ttft_ms_range": [min(ttft), max(ttft)],
                         "prefill_tokens_per_s_median": statistics.median(rates),
                         "prefill_tokens_per_s_range": [min(rates), max(rates)],
                         "first_tokens": [row["tokens"][0] for row in rows]}
        if "steps_ms" in rows[0]:
            summary[name]["steps_ms_first_round"] = rows[0]["steps_ms"]
    rate = "prefill_tokens_per_s_median"
    summary["ratios"] = {f"{name}_vs_optimum": summary[name][rate] / summary["optimum"][rate]
                         for name in decoders if name.startswith("numaov")}
    summary["ratios"].update({  # each round's ratio of times to the first token, median
        f"{name}_vs_optimum_round_median": statistics.median(
            o / n for n, o in zip(summary[name]["ttft_ms_rounds"],
                                  summary["optimum"]["ttft_ms_rounds"], strict=True))
        for name in decoders if name.startswith("numaov")})
    if "numaov_dp2" in summary:
        summary["ratios"]["dp2_vs_dp1"] = (summary["numaov_dp2"][rate]
                                           / summary["numaov_dp1"][rate])
    summary["ratios"]["dp1_same_first_tokens_as_optimum"] = (
        summary["numaov_dp1"]["first_tokens"] == summary["optimum"]["first_tokens"])
    log(f"prefill ratios: {summary['ratios']}")
    return summary


# -- the run ----------------------------------------------------------------------------------


def main() -> None:
    global BATCHES, NEW_TOKENS, RELEASED_FP8, FP8_DENSE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="deepseek_v2", choices=lm_checkpoints.FAMILIES,
                        help="the checkpoint's model family (lm_checkpoints.py)")
    parser.add_argument("--sections", default="decode,context,kv",
                        help="of decode,prefill,greedy,context,kv,profile,roofline")
    parser.add_argument("--precision", default="f32", choices=("f32", "bf16"),
                        help="inference precision of both systems")
    parser.add_argument("--weights", choices=("f32", "bf16", "int8", "int4", "fp8"),
                        help="weight format of both systems (default: the precision's; fp8: "
                             "optimum-intel at OPTIMUM_WEIGHTS)")
    parser.add_argument("--also", default="",
                        help="other PRECISION:WEIGHTS formats timed in the same decode rounds "
                             "(numaov dp=1, and optimum-intel once per format), e.g. "
                             "bf16:bf16,bf16:fp8")
    parser.add_argument("--released-fp8", action="store_true",
                        help="numaov's fp8 exports read the checkpoint rewritten in DeepSeek's "
                             "released FP8 layout (lm_checkpoints.released_fp8; deepseek_v3 "
                             "only), whose experts it keeps as released; without it numaov "
                             "quantizes the bf16 checkpoint's experts itself")
    parser.add_argument("--fp8-dense", action="store_true",
                        help="with --released-fp8: the fp8 exports keep the attention and MLP "
                             "projections fp8 too (numaov export lm --fp8-dense)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="decode batch sizes (default 1,8,32)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="decode and prefill rounds (every system at every batch once per "
                             "round)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                        help=f"greedy tokens per decode request (default {NEW_TOKENS})")
    args = parser.parse_args()
    args.weights = args.weights or args.precision
    use_family(args.family)
    BATCHES = tuple(int(b) for b in args.batches.split(","))
    NEW_TOKENS = args.new_tokens
    if args.released_fp8 and args.family != "deepseek_v3":
        parser.error("--released-fp8: only --family deepseek_v3 has a released FP8 layout")
    if args.fp8_dense and not args.released_fp8:
        parser.error("--fp8-dense: only with --released-fp8 (a released FP8 checkpoint's)")
    RELEASED_FP8, FP8_DENSE = args.released_fp8, args.fp8_dense
    also = [tuple(item.split(":")) for item in filter(None, args.also.split(","))]
    sections = set(args.sections.split(","))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)), "load_start": uptime(), "family": args.family,
        "precision": args.precision, "weights": args.weights, "rounds": args.rounds,
        "batches": list(BATCHES), "new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_LEN,
        "released_fp8": RELEASED_FP8, "fp8_dense": FP8_DENSE,
        "also": [f"{p}:{w}" for p, w in also],
        "command": " ".join(["python", "benchmarks/lm_engine.py", *sys.argv[1:]]),
    }
    log(f"load at start: {results['load_start']}")
    checkpoint = build_checkpoint()
    results["checkpoint"] = str(checkpoint.relative_to(HERE))
    ranks = (1, 2) if sections & {"decode", "prefill", "context", "profile"} else (1,)
    dirs = {dp: numaov_export(checkpoint, dp, args.precision, args.weights) for dp in ranks}
    inference = "f32" if args.precision == "f32" else "bf16"
    if sections & {"decode", "prefill"}:
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
        results["optimum_runtime"] = {
            name: {key: decoders[name].started[key]
                   for key in ("runtime_layer_types", "experts_runtime_nodes")}
            for name in optimum_formats.values()}
        results["optimum_runs"] = {name: f"{w} weights, {p} inference"
                                   for (p, w), name in optimum_formats.items()}
        try:
            if "decode" in sections:
                reads = None
                if "roofline" in sections and 1 in BATCHES:
                    import roofline  # benchmarks/roofline.py, beside this file
                    reads = roofline.ReadSampler(sorted(os.sched_getaffinity(0)),
                                                 roofline.l3_bytes())
                results.update(decode_rounds(decoders, args.rounds, reads))
                if reads is not None:
                    results["batch1_read_shares"] = batch1_read_shares(
                        results, weights_read_per_token(dirs[1])["total_bytes"])
            if "prefill" in sections:
                results["prefill"] = prefill_rounds(decoders, args.rounds)
        finally:
            for decoder in decoders.values():
                decoder.close()
    if "decode" in sections:
        ratios = {}
        for b in map(str, BATCHES):
            opt, one, two = (results[k][b] for k in ("optimum", "numaov_dp1", "numaov_dp2"))
            rate = "decode_tokens_per_s_median"
            rounds = "decode_tokens_per_s_rounds"
            ratios[b] = {
                "dp1_vs_optimum": one[rate] / opt[rate],
                "dp2_vs_dp1": two[rate] / one[rate],
                # the median of each round's ratio: both sides of a round ran within a minute
                # of each other, so a load that moves between rounds cancels in it
                "dp1_vs_optimum_round_median": statistics.median(
                    a / b for a, b in zip(one[rounds], opt[rounds], strict=True)),
                "dp2_vs_dp1_round_median": statistics.median(
                    a / b for a, b in zip(two[rounds], one[rounds], strict=True)),
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
    if "greedy" in sections:
        results["greedy"] = greedy_check(checkpoint)
    if "context" in sections:
        results["context_ms"] = {f"dp{dp}": engine_context(dirs[dp], dp) for dp in (1, 2)}
    if "roofline" in sections:
        results["roofline"] = step_roofline(dirs[1], args.rounds)
    if "profile" in sections:
        results["profile"] = profile_dp(dirs)
        results["profile"]["optimum"] = optimum_script(_OPTIMUM_PROFILE, inference, args.weights)
        log(f"profile optimum-intel: {results['profile']['optimum']}")
    if "kv" in sections:
        results["kv_candidates_ms"] = kv_candidates(checkpoint, dirs[1], inference)
        results["kv_candidates_ms"]["optimum_graph"] = optimum_script(
            _OPTIMUM_PAGED, inference, args.weights, json.dumps(list(CONTEXTS)), str(PA_BLOCK))
        log(f"kv optimum-intel's graph: {results['kv_candidates_ms']['optimum_graph']}")
    results["load_end"] = uptime()
    log(f"load at end: {results['load_end']}")
    out = Path(str(OUT if args.family == "deepseek_v2" else OUT_FAMILY).format(
        family=args.family, precision=args.precision,
        weights=args.weights + ("_released" if RELEASED_FP8 else "")
        + ("_dense" if FP8_DENSE else "")))
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

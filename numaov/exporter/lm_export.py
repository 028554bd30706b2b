"""Export a language-model checkpoint of any family once per DP rank to ONNX and OpenVINO IR.

The family (``numaov.models.families``) comes from the checkpoint's ``config.json``; this
module reads nothing of the family's config but through it. ``export_lm`` writes, into
``out_dir``:

- ``rank_<r>/experts.nxs``: the rank's routed experts of every MoE layer (its shard of each
  expert) in the weight format ``weights`` names, streamed from the checkpoint one expert at a
  time, each read once for all ranks (``expert_streaming``) into numaov's expert store (``custom_ops.expert_store``);
- ``rank_<r>/model.onnx`` + ``model.onnx.data`` (always f32) and ``rank_<r>/model.xml`` +
  ``model.bin`` (the other weights in ``weight_formats.other_weights_storage``'s format) for
  every rank ``r < dp``: the family's pooled step (``LMFamily.step_module``) of the model that
  holds rank r's MLP shard and no routed experts: each MoE layer's experts are one
  ``numaov.moe::MoeExperts`` node (``custom_ops/moe_ops.py``) naming the rank's store and the
  layer, and the ``numaov.collective`` nodes (group ``COLLECTIVE_GROUP``) sit around every MLP
  and MoE block and the rank's vocabulary slice of the head when ``dp > 1``;
- ``reference_sample.npz`` (``dp == 1`` only): one parity input set and PyTorch's output;
- the checkpoint's tokenizer files (``TOKENIZER_FILES``), copied when present, so the export
  alone takes text prompts;
- ``<use>.safetensors`` per group of tensors the family keeps aside (``LMFamily.kept_aside``:
  DeepSeek-V3's multi-token-prediction layers), copied byte for byte as the checkpoint stores
  them, named in the manifest's ``kept_aside``;
- ``manifest.json``, written last, with every other file's size and digest (a store carries a
  digest per layer in its own header instead, checked when a process opens it).

The files are written into a staging directory that replaces ``out_dir`` only once parity
passed (``output_dir.staged_output``): a failed export leaves nothing behind, a re-export
no stale file.

Graph inputs: ``input_ids``, ``position_ids`` ``[batch, new_tokens]`` (int64),
``attention_mask`` ``[batch, total_tokens]`` (int64, 1 = real token; cached and new tokens),
``kv_cache`` ``[layers, cache_tokens, width]`` (the rank's token pool, which the runtime owns
and passes without a copy; ``width``, what its values are and their type: the family's
``CacheLayout``, whose ``dtype`` is the export's precision) and ``past_slots``
``[batch, past_tokens]`` (int64: the pool slot of each cached token of each row). Outputs:
``logits [batch, vocab]`` (the last new token of each row) and ``new_key_values
[layers, batch, new_tokens, width]``: this step's entries only, which the runtime writes into
its pool. Every
named axis is dynamic; ``batch`` may be 0 when ``dp > 1`` (a rank with no sequences still runs
every step). ``total_tokens`` has its own axis: torch.export refuses ``past_tokens +
new_tokens`` as an input's shape.

``new_tokens`` is declared ``Dim.DYNAMIC`` rather than a named ``Dim``: reshapes in the
attention make torch.export ask whether the axis is 1 (the answer only decides whether a
reshape is a view or a copy), which a named ``Dim`` turns into an error. The parity check runs
both 1 and several new tokens, so a graph that only worked for one of them would fail it.

The PyTorch reference is the unsharded model whose routed experts are read from the
checkpoint as rows reach them (``layers.experts.CheckpointExperts``): it computes with the
checkpoint's own weights (f32) and holds none of the experts, so no step of the export holds
more than the non-expert weights and one expert.

Parity at export:

- ONNX Runtime has no kernels for the numaov.moe node (nor, for ``dp > 1``, the collective
  nodes): the manifest's ``notes`` say so, with ONNX Runtime's refusal as checked on the graph.
- ``dp == 1``: PyTorch versus OpenVINO (``numaov.exporter.parity``).
- ``dp > 1``: every rank's OpenVINO graph runs
  in its own process of a rank group (``numaov.distributed.rank_group``, which joins the
  shared-memory group the nodes name), each on its own share of the sequences: uneven prefill,
  decode with idle ranks. Each rank's outputs are compared with the
  unsharded PyTorch model (dp=1) on the same sequences. The ranks are not pinned: placement
  changes the speed, not the numbers, and an export should not need a two-socket machine to be
  checked; each rank gets an equal share of the allowed CPUs as OpenVINO threads.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from numaov import NumaovError
from numaov.arrays import NUMPY_DTYPES, to_torch
from numaov.custom_ops.expert_store import STORE_NAME, open_store
from numaov.exporter.expert_streaming import (
    fp8_block,
    open_checkpoint,
    reference_experts,
    write_rank_stores,
)
from numaov.exporter.onnx_export import export_onnx
from numaov.exporter.openvino_convert import INFERENCE_PRECISION, check_precision, convert_to_ir
from numaov.exporter.output_dir import (
    digest_export,
    library_versions,
    staged_output,
    write_reference_sample,
)
from numaov.exporter.parity import (
    ParityFigure,
    check_parity,
    judge,
    measure,
    openvino_runner,
    parity_attention,
    summary,
    torch_reference,
)
from numaov.exporter.release import release_freed_memory
from numaov.exporter.weight_formats import (
    MIN_ROW_SHARE,
    MIN_TOKEN_SHARE,
    check_weights,
    compress_other_weights,
    expert_group_size,
    other_weights_storage,
    parity_tolerance,
    rounding_format,
    row_criterion,
    row_criterion_note,
)
from numaov.manifest import LM_KIND, ExportManifest, RankFiles, TensorSpec
from numaov.models.families import (
    STEP_INPUTS,
    STEP_OUTPUTS,
    CacheLayout,
    ExpertShape,
    LMFamily,
    family_for_checkpoint,
)

logger = logging.getLogger(__name__)

#: The group name baked into the collective nodes; the runtime's workers join this group.
COLLECTIVE_GROUP = "lm"
LOWERING = "decomposed"
INPUT_NAMES = STEP_INPUTS
OUTPUT_NAMES = STEP_OUTPUTS
ONNX_NAME = "model.onnx"
IR_NAME = "model.xml"
REFERENCE_SAMPLE_NAME = "reference_sample.npz"
# The Hugging Face tokenizer files an export carries along from its checkpoint, when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
# The example the graph is traced with: (batch, new tokens, cached tokens), all different
# from each other and from 0/1, which torch.export would specialise.
EXAMPLE_SHAPE = (2, 3, 4)
PARITY_SEED = 0
# Parity scenarios: per scenario, the (batch, new tokens, cached tokens) of ranks 0, 1, ...;
# ranks beyond the list are idle (batch 0) in that scenario. With the tiny model's 8 experts
# and top-2, the first two take the MoE's dense branch (rows * top_k > experts), the third the
# per-row gather; dp=1 runs rank 0's column.
PARITY_SCENARIOS: tuple[tuple[tuple[int, int, int], ...], ...] = (
    ((2, 5, 0), (1, 3, 0)),  # prefill of different lengths on each rank, left padding
    ((3, 1, 6),),  # decode on rank 0 only: every other rank idle
    ((1, 1, 4), (2, 1, 9)),  # decode with different cache lengths per rank
)
# An export that rounds is judged on a share of rows (``weight_formats.row_criterion``), and
# each phase (``manifest.row_phase``: prefill, decode with a cache) on a share of its own,
# which needs enough rows in each to mean something: two more scenarios per rank, a prefill of
# 32 sequences (32 logits rows and 32 x 6 new tokens per layer) and a decode step of 32
# sequences with 8 cached tokens each, after the others so their inputs (and the reference
# sample) are the same for every format.
ROW_SCENARIOS: tuple[tuple[tuple[int, int, int], ...], ...] = (
    ((32, 6, 0), (32, 6, 0)),
    ((32, 1, 8), (32, 1, 8)),
)
# The names the manifest gives the graph's axes (ONNX names the Dim.DYNAMIC axes itself).
AXIS_NAMES: dict[str, list[str | None]] = {
    "input_ids": ["batch", "new_tokens"],
    "position_ids": ["batch", "new_tokens"],
    "attention_mask": ["batch", "total_tokens"],
    "kv_cache": [None, "cache_tokens", None],
    "past_slots": ["batch", "past_tokens"],
    "logits": ["batch", None],
    "new_key_values": [None, "batch", "new_tokens", None],
}
_MAX_BATCH = 4096
PARITY_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class _StepSpec:
    """What the step's inputs need of a family's config: the vocabulary, the positions and
    the cache layout."""

    vocab_size: int
    max_positions: int
    cache: CacheLayout

    @classmethod
    def of(cls, family: LMFamily, config: Any, precision: str) -> _StepSpec:
        """The pool holds the export's precision: a bf16 graph computes attention in bf16,
        so f32 entries would carry nothing more and cost twice the bytes."""
        values = family.config_dict(config)
        cache = replace(family.cache_layout(config), dtype=precision)
        return cls(int(values["vocab_size"]), int(values["max_position_embeddings"]), cache)


class LMExportError(NumaovError):
    """The language-model export request is malformed (bad directory, dp, precision)."""


def _step_inputs(
    spec: _StepSpec, shape: tuple[int, int, int], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One step's inputs for ``shape = (batch, new tokens, cached tokens)``: the first
    sequence left-padded by two tokens when it has room, positions counted from each
    sequence's first real token, a random (f32) pool with spare slots and each row's cached
    tokens at shuffled slots of it, as the engine's pool holds them."""
    batch, new, past = shape
    pool = batch * past + 5
    total = past + new
    mask = np.ones((batch, total), dtype=np.int64)
    if batch and total > 3:
        mask[0, :2] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, past:]
    return {
        "input_ids": rng.integers(0, spec.vocab_size, (batch, new), dtype=np.int64),
        "position_ids": np.ascontiguousarray(positions, dtype=np.int64),
        "attention_mask": mask,
        "kv_cache": rng.standard_normal(
            (spec.cache.layers, pool, spec.cache.width), dtype=np.float32
        ).astype(NUMPY_DTYPES[spec.cache.dtype]),
        "past_slots": rng.permutation(pool)[: batch * past].reshape(batch, past),
    }


def _rank_inputs(spec: _StepSpec, dp: int, by_rows: bool = False
                 ) -> list[list[dict[str, np.ndarray]]]:
    """``inputs[rank][scenario]``: every rank's share of every parity scenario (and of
    ``ROW_SCENARIOS`` when ``by_rows``)."""
    rng = np.random.default_rng(PARITY_SEED)
    idle = (0, 1, 0)
    scenarios = PARITY_SCENARIOS + (ROW_SCENARIOS if by_rows else ())
    return [
        [
            _step_inputs(spec, scenario[rank] if rank < len(scenario) else idle, rng)
            for scenario in scenarios
        ]
        for rank in range(dp)
    ]


def _dynamic_shapes(spec: _StepSpec, dp: int) -> dict[str, dict[int, Any]]:
    dim = torch.export.Dim
    # An idle DP rank runs with batch 0; a single rank always has a sequence.
    batch = dim("batch", min=0 if dp > 1 else 1, max=_MAX_BATCH)
    positions = spec.max_positions
    past = dim("past_tokens", min=0, max=positions)
    total = dim("total_tokens", min=1, max=positions)
    pool = dim("cache_tokens", min=1, max=2**31 - 1)
    return {
        "input_ids": {0: batch, 1: dim.DYNAMIC},
        "position_ids": {0: batch, 1: dim.DYNAMIC},
        "attention_mask": {0: batch, 1: total},
        "kv_cache": {1: pool},
        "past_slots": {0: batch, 1: past},
    }


def _named_axes(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The graph's tensor specs with every dynamic axis under its documented name."""
    named = []
    for spec in specs:
        names = AXIS_NAMES.get(spec.name, [])
        shape = [
            names[i] if i < len(names) and names[i] is not None and isinstance(d, str) else d
            for i, d in enumerate(spec.shape)
        ]
        named.append(TensorSpec(name=spec.name, dtype=spec.dtype, shape=shape))
    return named


def _check_request(dp: int, precision: str) -> None:
    """Fail before the (possibly long) model load, and before creating anything."""
    check_precision(precision)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise LMExportError(f"dp is {dp!r}; expected a positive integer", parameter="dp")


@dataclass(frozen=True)
class _ParityJob:
    """What one parity worker needs; plain data, so it pickles into a spawned process."""

    xml: str
    inference_precision: str
    input_sets: list[dict[str, np.ndarray]]
    threads: int


def _run_rank_graph(context: Any, job: _ParityJob) -> tuple[list[list[np.ndarray]], str]:
    """Worker body: compile this rank's IR as the runtime does and run its share of every
    parity scenario; returns the outputs and the attention kernel they ran on."""
    run, attention = openvino_runner(
        job.xml, job.inference_precision, {"INFERENCE_NUM_THREADS": job.threads}
    )
    return [run(feeds) for feeds in job.input_sets], attention


def _check_ranks_on_workers(
    xml_paths: list[Path],
    rank_inputs: list[list[dict[str, np.ndarray]]],
    references: list[list[list[np.ndarray]]],
    inference_precision: str,
    progress: Callable[[str], None],
    tolerance: float | None = None,
    min_row_share: float | None = None,
    min_token_share: float | None = None,
) -> tuple[list[ParityFigure], str]:
    """Run every rank's IR in its own worker and compare with PyTorch dp=1; returns the
    figures and a description of the placement used."""
    from numaov.distributed.rank_group import run_rank_group

    dp = len(xml_paths)
    threads = max(1, len(os.sched_getaffinity(0)) // dp)
    placement = f"{dp} unpinned rank processes with {threads} OpenVINO thread(s) each"
    progress(f"parity check on openvino ({inference_precision}), {dp} ranks in worker "
             f"processes ({placement})")
    jobs = [
        _ParityJob(str(xml), inference_precision, inputs, threads)
        for xml, inputs in zip(xml_paths, rank_inputs, strict=True)
    ]
    results = run_rank_group(dp, _run_rank_graph, jobs, group=COLLECTIVE_GROUP,
                             timeout_s=PARITY_TIMEOUT_S)
    figures = []
    for rank, ((outputs, attention), expected, inputs) in enumerate(
        zip(results, references, rank_inputs, strict=True)
    ):
        for got, ref, feeds in zip(outputs, expected, inputs, strict=True):
            shapes = {name: list(array.shape) for name, array in feeds.items()}
            for name, r, g in zip(OUTPUT_NAMES, ref, got, strict=True):
                figure = measure(r, g, "openvino", inference_precision, f"rank{rank}.{name}",
                                 shapes, tolerance, attention, min_row_share,
                                 min_token_share)
                logger.info("parity: %s", figure.describe())
                figures.append(figure)
    figures = judge(figures, f"the dp={dp} rank graphs do not match the unsharded PyTorch model")
    progress(summary(figures))
    return figures, placement


def _onnxruntime_refusal(onnx_path: Path) -> str:
    """Why ONNX Runtime is not in a language-model export's parity check, as ONNX Runtime's own check
    says: every MoE layer is a numaov.moe node (and, for several ranks, collectives)."""
    from numaov.custom_ops import OnnxRuntimeUnsupportedError, check_onnxruntime_can_run

    try:
        check_onnxruntime_can_run(onnx_path)
    except OnnxRuntimeUnsupportedError as exc:
        return f"onnxruntime not checked: {exc}"
    raise LMExportError(
        f"{str(onnx_path)!r} holds no numaov nodes; expected a numaov.moe MoeExperts node in "
        "every MoE layer (and collectives around every MLP and MoE block for several ranks)"
    )


def export_lm(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dp: int = 1,
    precision: str = "f32",
    progress: Callable[[str], None] | None = None,
    force: bool = False,
    weights: str | None = None,
    fp8_dense: bool = False,
) -> ExportManifest:
    """Export the language-model checkpoint in ``checkpoint_dir`` (its family by the
    ``model_type`` of its ``config.json``) for ``dp`` ranks; returns the manifest written to
    ``out_dir``. ``force`` replaces an ``out_dir`` that holds something
    other than a numaov export. ``weights`` is the IR's weight format (``weight_formats``:
    f32, bf16, int8, int4, fp8; default: ``precision``'s). ``fp8_dense``: with fp8 weights of a
    released FP8 checkpoint, its attention and MLP projections stay fp8 too
    (``dense_projections``); refused otherwise. An export computed in bf16 with its other
    weights stored bf16, made where the experts' bf16 kernel is AVX512-BF16 (no AMX), runs its
    bf16 projections and head on that kernel too (``dense_projections.bf16_projections_here``).

    Raises ``ShardError`` when ``dp`` does not divide the sharded dims, ``CheckpointError``
    when the checkpoint does not fit its config, ``ParityError`` (``out_dir`` left as it was)
    when a backend differs from PyTorch beyond the tolerance of ``numaov.exporter.parity``.
    """
    report = progress or (lambda _msg: None)
    checkpoint_dir = Path(checkpoint_dir)
    _check_request(dp, precision)
    weights = check_weights(weights, precision)
    family = family_for_checkpoint(checkpoint_dir)
    config = family.read_config(checkpoint_dir)
    if fp8_dense and (weights != "fp8" or fp8_block(config) is None):
        raise LMExportError(
            f"keeping the projections fp8 is for a released FP8 checkpoint's; expected "
            f"--weights fp8 (got {weights}) and a checkpoint with an FP8 quantization_config"
            + ("" if fp8_block(config) is not None else f" ({checkpoint_dir} has none)"),
            parameter="fp8_dense")
    family.check_dp(config, dp)
    experts = family.expert_shape(config, dp)
    group_size = (expert_group_size(weights, experts.hidden, experts.intermediate)
                  if experts is not None else None)
    with staged_output(out_dir, force) as staging:  # published when the block returns
        return _export_into(checkpoint_dir, staging, family, config, dp, precision, report,
                            weights, experts, group_size, fp8_dense)


def _copy_tokenizer(checkpoint_dir: Path, out_dir: Path) -> list[str]:
    """Copy the checkpoint's tokenizer files into the export, so the export alone serves and
    runs text prompts (``numaov serve`` / ``run lm`` read ``tokenizer.json`` and the chat
    template from the model directory). The names of the files copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (checkpoint_dir / name).is_file():
            shutil.copy2(checkpoint_dir / name, out_dir / name)
            copied.append(name)
    return copied


def _keep_aside(checkpoint_dir: Path, out_dir: Path, family: LMFamily, config: Any,
                report: Callable[[str], None]) -> dict[str, str]:
    """Copy each group of tensors the family keeps aside into ``<use>.safetensors`` as
    stored; the manifest's ``kept_aside`` (use -> file)."""
    checkpoint = open_checkpoint(checkpoint_dir, "checkpoint")
    files = {}
    for use, names in family.kept_aside(config, list(checkpoint)).items():
        files[use] = f"{use}.safetensors"
        size = checkpoint.copy_to(names, out_dir / files[use])
        report(f"kept aside {len(names)} {use.replace('_', '-')} tensors as stored "
               f"({size / 2**20:.1f} MiB, {files[use]}): numaov runs the main model only")
    return files


def _export_into(
    checkpoint_dir: Path,
    out_dir: Path,
    family: LMFamily,
    config: Any,
    dp: int,
    precision: str,
    report: Callable[[str], None],
    weights: str,
    experts: ExpertShape | None,
    group_size: int | None,
    fp8_dense: bool,
) -> ExportManifest:
    from numaov.exporter.dense_projections import (
        bf16_projections,
        bf16_projections_here,
        int8_projections,
        int8_projections_here,
        keep_fp8_projections,
    )
    from numaov.models.checkpoint import compute_in_f32
    from numaov.models.layers.data_parallel import DataParallelGroup
    from numaov.models.layers.experts import StoredExperts

    inference_precision = INFERENCE_PRECISION[precision]
    # the rules of the format that rounds the weights: a released FP8 checkpoint's experts
    # are stored as they are, so its parity is the precision's (the reference reads the same
    # dequantized values)
    rounded = rounding_format(weights, precision, released_fp8=fp8_block(config) is not None)
    tolerance = parity_tolerance(rounded, inference_precision)
    by_rows = row_criterion(rounded, inference_precision)
    min_row_share = None if by_rows is None else MIN_ROW_SHARE[by_rows]
    min_token_share = None if by_rows is None else MIN_TOKEN_SHARE[by_rows]
    storage = other_weights_storage(weights, precision)
    # asked before any slow work: a bad NUMAOV_MOE_AMX / VNNI / ISA is refused here
    on_kernel = bf16_projections_here(precision, storage)
    int8_on_kernel = int8_projections_here(precision, weights)

    spec = _StepSpec.of(family, config, precision)

    def compress(model: Any) -> None:
        # the router's rows ([experts, hidden]) stay f32, as transformers keeps the router
        compress_other_weights(model, weights, group_size,
                               experts.num_experts if experts is not None else None)
    timings: dict[str, float] = {}
    rank_inputs = _rank_inputs(spec, dp, by_rows=min_row_share is not None)
    # A bf16 IR of a bf16 (or f16) checkpoint: the models hold the weights as the checkpoint
    # does and compute in f32 (compute_in_f32), so no f32 copy of them is made and the ONNX
    # graph carries them at that width; otherwise f32, as the IR or the reference needs.
    load_dtype = "auto" if storage == "bf16" else torch.float32

    # 1. the routed experts: streamed from the checkpoint into each rank's expert store
    store_files: list[str | None] = [None] * dp
    if experts is not None:
        store_files = [f"rank_{rank}/{STORE_NAME}" for rank in range(dp)]
        written = write_rank_stores([out_dir / f for f in store_files], checkpoint_dir, config,
                                    experts, weights, group_size, report)
        report(f"expert stores: {written.describe()}")
        timings["expert_store"] = written.seconds

    # 2. the unsharded model, its experts read from the checkpoint as rows reach them: the
    # parity reference for every rank's share
    start = time.perf_counter()
    report(f"loading {family.title} checkpoint {checkpoint_dir} (experts read as used)")
    model = family.load(checkpoint_dir, load_dtype,
                        experts=reference_experts(checkpoint_dir, config))
    compute_in_f32(model)
    timings["load"] = time.perf_counter() - start
    start = time.perf_counter()
    report("running PyTorch (dp=1) on the parity inputs")
    references = [torch_reference(family.step_module(model), inputs) for inputs in rank_inputs]
    timings["torch_reference"] = time.perf_counter() - start
    del model
    release_freed_memory()

    # 3. per rank: the shard without its experts (the graph names the store), ONNX, IR
    example = {
        name: to_torch(array)
        for name, array in _step_inputs(spec, EXAMPLE_SHAPE, np.random.default_rng(1)).items()
    }
    graphs, xml_paths, rank_files = [], [], []
    dense_notes: list[str] = []
    for rank in range(dp):
        start = time.perf_counter()
        report(f"rank {rank}/{dp}: loading its shard")
        group = DataParallelGroup(COLLECTIVE_GROUP, rank, dp) if dp > 1 else None
        stored = None
        if store_files[rank] is not None:
            store_id = open_store(out_dir / store_files[rank]).store_id
            stored = functools.partial(StoredExperts, store_id)
        shard = family.load(checkpoint_dir, load_dtype, group, experts=stored)
        if fp8_dense:
            kept = keep_fp8_projections(shard, checkpoint_dir, config, group)
            if rank == 0:
                dense_notes.append(f"{kept} attention and MLP projections per rank kept in "
                                   "the release's FP8, on numaov's DenseLinear op")
                report(dense_notes[-1])
        if on_kernel:
            moved = bf16_projections(shard)
            if rank == 0:
                dense_notes.append(f"{moved} bf16 projections per rank on numaov's DenseLinear "
                                   "op (exported where its bf16 kernel is AVX512-BF16: faster "
                                   "than OpenVINO's FullyConnected at a few rows a call)")
                report(dense_notes[-1])
        if int8_on_kernel:
            moved = int8_projections(shard)
            if rank == 0:
                dense_notes.append(f"{moved} int8 projections per rank on numaov's DenseLinear "
                                   "op (exported where its int8 kernel is AVX512-VNNI)")
                report(dense_notes[-1])
        narrow = compute_in_f32(shard) > 0  # the graph holds bf16 weights behind Casts
        timings["load"] += time.perf_counter() - start
        start = time.perf_counter()
        rank_dir = out_dir / f"rank_{rank}"
        graph = export_onnx(
            family.step_module(shard), (), example, _dynamic_shapes(spec, dp),
            rank_dir / ONNX_NAME, LOWERING, report, output_names=list(OUTPUT_NAMES),
        )
        timings["onnx_export"] = timings.get("onnx_export", 0.0) + time.perf_counter() - start
        del shard
        release_freed_memory()
        start = time.perf_counter()
        xml_path = convert_to_ir(graph.path, rank_dir / IR_NAME, storage, report,
                                 compress if weights in ("int8", "int4") else None,
                                 keep_weight_casts=narrow,
                                 computes_in_bf16=inference_precision == "bf16")
        timings["openvino_convert"] = (
            timings.get("openvino_convert", 0.0) + time.perf_counter() - start
        )
        graphs.append(graph)
        xml_paths.append(xml_path)
        rank_files.append(
            RankFiles(
                rank=rank,
                onnx=f"rank_{rank}/{ONNX_NAME}",
                ir_xml=f"rank_{rank}/{IR_NAME}",
                ir_bin=f"rank_{rank}/{xml_path.with_suffix('.bin').name}",
                experts=store_files[rank],
            )
        )

    # 4. parity
    start = time.perf_counter()
    notes: list[str] = []
    reference_sample = None
    notes.append(_onnxruntime_refusal(graphs[0].path))
    notes.extend(dense_notes)
    if dp == 1:
        figures = check_parity(
            rank_inputs[0], references[0], list(OUTPUT_NAMES), None, xml_paths[0],
            openvino_precision=inference_precision, progress=report,
            tolerances=None if tolerance is None else {inference_precision: tolerance},
            min_row_share=min_row_share, min_token_share=min_token_share,
        )
        write_reference_sample(
            out_dir / REFERENCE_SAMPLE_NAME, rank_inputs[0][0],
            dict(zip(OUTPUT_NAMES, references[0][0], strict=True)),
        )
        reference_sample = REFERENCE_SAMPLE_NAME
    else:
        figures, placement = _check_ranks_on_workers(
            xml_paths, rank_inputs, references, inference_precision, report, tolerance,
            min_row_share, min_token_share,
        )
        notes.append(
            f"openvino checked with the {dp} rank graphs in {dp} worker processes sharing "
            f"collective group {COLLECTIVE_GROUP!r} ({placement}), each rank's outputs "
            "against the unsharded PyTorch model on the same sequences"
        )
    timings["parity"] = time.perf_counter() - start
    if by_rows is not None:
        notes.append(row_criterion_note(by_rows, inference_precision, figures))

    copied = _copy_tokenizer(checkpoint_dir, out_dir)
    if copied:
        report(f"copied the checkpoint's tokenizer ({', '.join(copied)})")
    kept_aside = _keep_aside(checkpoint_dir, out_dir, family, config, report)
    manifest = ExportManifest(
        kind=LM_KIND,
        family=family.name,
        cache_layout=spec.cache.to_dict(),
        config=family.config_dict(config),
        inputs=_named_axes(graphs[0].inputs),
        outputs=_named_axes(graphs[0].outputs),
        precision=precision,
        inference_precision=inference_precision,
        lowering=LOWERING,
        ranks=rank_files,
        versions=library_versions(),
        parity=[f.as_dict() for f in figures],
        source_checkpoint=str(checkpoint_dir.resolve()),
        export_seconds={k: round(v, 3) for k, v in timings.items()},
        reference_sample=reference_sample,
        collective_group=COLLECTIVE_GROUP if dp > 1 else None,
        notes=notes,
        world_size=dp,
        weights=weights,
        weights_group_size=group_size,
        parity_attention=parity_attention(figures),
        files=digest_export(out_dir, skip=[f for f in store_files if f is not None]),
        kept_aside=kept_aside,
    )
    manifest.write_and_report(out_dir, timings, report)
    return manifest

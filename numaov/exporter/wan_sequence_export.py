"""The sequence-parallel graphs of a Wan transformer export (``--sequence-parallel N``).

For each rank count ``N`` the transformer is exported once more, split over ``N`` ranks
(``models/wan/sequence_parallel.py``), into ``sequence_<N>/`` beside its plain graph:

- ``model.xml`` / ``model.bin``: one graph every rank runs, the rank's index an input
  (``sequence_rank``), the ``all_to_all`` and ``all_gather_into_tensor`` collectives of group
  ``wan-sequence`` in it. The ranks hold the same weights, so one IR serves them all (its
  manifest lists ``N`` ranks on the same files) instead of ``N`` copies on disk; its ONNX,
  traced on the way, is removed once converted (no ONNX runtime has the collectives);
- ``manifest.json``: ``world_size`` ``N``, the group, the parity figures.

It is written before the plain graph's manifest, so that one digests these files too.

Parity: every rank compiles the IR in its own process, runs the whole video (the parity input
sets, plus one whose token count divides by no rank count, so padded shares are checked) and
must return the unsplit graph's sample, both compiled at f32 whatever the export precision:
the unsplit graph is the one judged against PyTorch (block by block at bf16), and the same
weights and kernels in both leave the split's own work, data movement, to be judged at the
f32 tolerance, where a wrong exchange or position is off by O(1). (At f32 the unsplit graph
is within 1e-4 of PyTorch; a bf16 IR's compressed weights compiled at f32 are 4e-4 from
PyTorch's f32 math on the same weights, which is why PyTorch is not the reference here.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from numaov import NumaovError
from numaov.exporter.onnx_export import export_onnx
from numaov.exporter.output_dir import digest_export, library_versions
from numaov.exporter.parity import judge, measure, openvino_runner, summary
from numaov.manifest import ExportManifest, RankFiles
from numaov.models.wan import RANK_INPUT, SEQUENCE_GROUP, sequence_dir_name
from numaov.models.wan.sequence_parallel import check_rank_count, check_sequence_split

OUTPUT_NAME = "sample"
PARITY_TIMEOUT_S = 1800.0
# One more parity input set, (batch, F', H', W', text): 7 tokens, which 2 to 6 ranks cannot
# share evenly, in one latent frame.
PADDED_SIZES = (1, 1, 1, 7, 6)


class WanSequenceExportError(NumaovError):
    """A sequence-parallel export request the transformer cannot take."""


def check_sequence_ranks(ranks: Sequence[int], heads: int | None, timestep: str) -> list[int]:
    """The rank counts, sorted and checked before any export work."""
    counts = sorted(set(ranks))
    if not counts:
        return []
    if timestep != "scalar":
        raise WanSequenceExportError(
            "--sequence-parallel needs one timestep per sample, but this transformer takes "
            "them per frame (--timestep per-frame, or a Wan 2.2 TI2V pipeline): its modulation "
            "rows are whole frames, which a share of the tokens need not hold; expected a "
            "text-to-video or I2V A14B transformer", parameter="sequence_parallel")
    for count in counts:
        try:
            if heads is None:
                check_rank_count(count)
            else:
                check_sequence_split(heads, count)
        except NumaovError as exc:
            raise WanSequenceExportError(str(exc), parameter="sequence_parallel") from None
    return counts


def check_transformer_split(transformer_dir: Path, ranks: Sequence[int],
                            timestep: str) -> list[int]:
    """``check_sequence_ranks`` for the transformer in ``transformer_dir`` (its config's
    heads), before any export work."""
    if not ranks:
        return []
    from numaov.models.checkpoint import read_config
    from numaov.models.wan.transformer import CONFIG_NAME, WanTransformerConfig

    config = WanTransformerConfig.from_dict(read_config(
        transformer_dir, CONFIG_NAME, f"Wan checkpoint {str(transformer_dir)!r}"))
    return check_sequence_ranks(ranks, config.num_attention_heads, timestep)


@dataclass
class SequenceGraph:
    """One rank count's ONNX graph, exported while the model was loaded."""

    ranks: int
    directory: Path
    graph: Any  # onnx_export.OnnxGraph


def export_sequence_onnx(model: torch.nn.Module, ranks: int, out_dir: Path,
                         example: dict[str, np.ndarray], dynamic_shapes: dict[str, Any],
                         onnx_name: str, lowering: str,
                         report: Callable[[str], None]) -> SequenceGraph:
    """Trace ``model`` split over ``ranks`` into ``out_dir/sequence_<ranks>/``; the model is
    left as it was."""
    directory = out_dir / sequence_dir_name(ranks)
    block_outputs = model.block_outputs
    model.block_outputs = False  # the step cache's states are a single process's
    model.split_sequence(ranks)
    report(f"exporting the graph for {ranks} sequence-parallel ranks")
    try:
        kwargs = {name: torch.from_numpy(array) for name, array in example.items()}
        kwargs[RANK_INPUT] = torch.zeros(1, dtype=torch.int64)
        graph = export_onnx(model, (), kwargs, {**dynamic_shapes, RANK_INPUT: None},
                            directory / onnx_name, lowering, report,
                            output_names=[OUTPUT_NAME])
    finally:
        model.sequence = None
        model.block_outputs = block_outputs
    return SequenceGraph(ranks, directory, graph)


@dataclass(frozen=True)
class _RankJob:
    xml: str
    input_sets: list[dict[str, np.ndarray]]
    threads: int


def _run_rank(context: Any, job: _RankJob) -> tuple[list[np.ndarray], str]:
    """Worker body: this rank's IR on every input set with its own index."""
    run, attention = openvino_runner(job.xml, "f32", {"INFERENCE_NUM_THREADS": job.threads})
    rank = np.array([context.rank], dtype=np.int64)
    return [run({**feeds, RANK_INPUT: rank})[0] for feeds in job.input_sets], attention


def finish_sequence_graph(
    part: SequenceGraph, convert: Callable[[Path, Path], Path], plain_xml: Path,
    input_sets: Sequence[dict[str, np.ndarray]], plain: ExportManifest,
    report: Callable[[str], None],
) -> ExportManifest:
    """Convert ``part`` to IR, check every rank against the unsplit graph ``plain_xml`` and
    write its manifest (``plain`` is the transformer's own, for what they share)."""
    from numaov.distributed.rank_group import run_rank_group

    xml_path = convert(part.graph.path, part.directory / plain_xml.name)
    # Only OpenVINO runs the split graph (its collectives are numaov's OpenVINO ops): its
    # ONNX, f32 and twice a bf16 IR's size, is not kept.
    for path in (part.graph.path, part.graph.data_path):
        if path is not None:
            path.unlink(missing_ok=True)
    run_whole, _ = openvino_runner(plain_xml, "f32")
    references = [run_whole(feeds)[0] for feeds in input_sets]
    del run_whole
    threads = max(1, len(os.sched_getaffinity(0)) // part.ranks)
    report(f"parity check of the {part.ranks}-rank sequence split on openvino (f32), one "
           f"process per rank")
    jobs = [_RankJob(str(xml_path), list(input_sets), threads)] * part.ranks
    results = run_rank_group(part.ranks, _run_rank, jobs, group=SEQUENCE_GROUP,
                             timeout_s=PARITY_TIMEOUT_S)
    figures = []
    for rank, (outputs, attention) in enumerate(results):
        for got, expected, feeds in zip(outputs, references, input_sets, strict=True):
            shapes = {name: list(array.shape) for name, array in feeds.items()}
            figures.append(measure(expected, got, "openvino", "f32", f"rank{rank}.{OUTPUT_NAME}",
                                   shapes, attention=attention))
    figures = judge(figures, f"the {part.ranks}-rank sequence-parallel graph does not match "
                             "the unsplit graph")
    report(summary(figures))
    manifest = ExportManifest(
        kind="wan",
        config=plain.config,
        inputs=part.graph.inputs,
        outputs=part.graph.outputs,
        precision=plain.precision,
        inference_precision=plain.inference_precision,
        lowering=plain.lowering,
        timestep=plain.timestep,
        ranks=[RankFiles(rank=r, onnx=None, ir_xml=xml_path.name,
                         ir_bin=xml_path.with_suffix(".bin").name) for r in range(part.ranks)],
        world_size=part.ranks,
        collective_group=SEQUENCE_GROUP,
        versions=library_versions(),
        parity=[f.as_dict() for f in figures],
        source_checkpoint=plain.source_checkpoint,
        files=digest_export(part.directory),
        loras=plain.loras,
    )
    manifest.write(part.directory)
    return manifest

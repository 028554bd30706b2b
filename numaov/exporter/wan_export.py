"""Export a Wan DiT checkpoint to ONNX and OpenVINO IR with dynamic video shapes.

``export_wan`` writes, into ``out_dir``:

- ``model.onnx`` + ``model.onnx.data`` (weights as external data), always f32;
- ``model.xml`` + ``model.bin``, the OpenVINO IR (bf16 weights for ``precision="bf16"``,
  see ``openvino_convert``);
- ``reference_sample.npz``: one parity input set and PyTorch's output on it;
- ``manifest.json``, written last, with every other file's size and digest.

A diffusers pipeline directory (``model_index.json``) is exported whole instead: text encoder,
transformer and VAE decoder, each in its own subdirectory as above, with one pipeline manifest
(``wan_pipeline_export``).

The files are written into a staging directory that replaces ``out_dir`` only once parity
passed (``output_dir.staged_output``): a failed export leaves nothing behind, a re-export
no stale file.

Batch, latent frames, height, width and text length stay dynamic. Frames, height and width
are declared as multiples of the patch size (``2 * Dim("height_patches")``), which is the
only shape the model accepts, so ``torch.export`` proves the graph valid for all of them.
The parity check runs at shapes other than the export example's on every axis.

``timestep="scalar"`` exports ``timestep [batch]`` (Wan 2.1, Wan 2.2 T2V);
``timestep="per-frame"`` exports ``timestep [batch, frame_patches]``, one timestep per latent
frame after patching (Wan 2.2 TI2V, whose conditioned first frame is at timestep 0). Its frame
axis is the same ``Dim`` as the video's, so the graph accepts exactly the pairs the model
does. The manifest's ``timestep`` field tells the sampler which one it got.

``loras`` (``--lora FILE[:SCALE]``) are LoRA adapters merged into the transformer's weights
before the export (``numaov.models.wan.lora``: read through diffusers' Wan LoRA loader,
merged in f32 as diffusers' ``fuse_lora(lora_scale=SCALE)``, one layer at a time); ``loras_2``
go into a pipeline's second expert, ``transformer_2``. Every file is read and checked against
the checkpoint's shapes before any export work; the manifest's ``loras`` names each one with
its digest and scale, and the parity reference is the merged model.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from numaov import NumaovError
from numaov.exporter.onnx_export import check_lowering, export_onnx
from numaov.exporter.openvino_convert import INFERENCE_PRECISION, check_precision, convert_to_ir
from numaov.exporter.output_dir import (
    digest_export,
    library_versions,
    staged_output,
    write_reference_sample,
)
from numaov.exporter.parity import (
    BACKENDS,
    check_parity,
    check_stages,
    judge,
    parity_attention,
    summary,
    torch_reference,
)
from numaov.exporter.release import release_freed_memory
from numaov.exporter.reuse import ComponentReuse, check_previous
from numaov.exporter.wan_pipeline_export import (
    TRANSFORMER_2_DIR,
    TRANSFORMER_DIR,
    export_pipeline_into,
    has_second_expert,
    is_pipeline_dir,
    pipeline_timestep,
    read_model_index,
)
from numaov.exporter.wan_sequence_export import (
    PADDED_SIZES,
    check_sequence_ranks,
    check_transformer_split,
    export_sequence_onnx,
    finish_sequence_graph,
)
from numaov.manifest import TIMESTEP_KINDS, ExportManifest, RankFiles
from numaov.models.wan import block_states, state_outputs
from numaov.models.wan.lora import LoraError, LoraSpec, WanLora

logger = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
REFERENCE_SAMPLE_NAME = "reference_sample.npz"
IR_NAME = "model.xml"
OUTPUT_NAME = "sample"
# Example sizes the graph is traced with, as (batch, frame / height / width patches, text
# length): all different from each other and from 0/1, which torch.export would specialise.
EXAMPLE_SIZES = (2, 3, 4, 5, 11)
# Parity shapes: every axis differs from the example (and batch 1 is covered).
PARITY_SIZES = ((1, 1, 2, 3, 5), (2, 2, 3, 2, 16))
PARITY_SEED = 0
# Generous upper bounds for the dynamic axes: Wan 2.1 at 720p x 81 frames is 21 x 45 x 80
# patches with 512 text tokens.
_MAX_PATCHES = 1024
_MAX_TEXT = 4096
_MAX_BATCH = 256
# The exported FFN runs as narrower up/GELU/down blocks of at most this many inner columns
# (WanFeedForward): Wan 1.3B's 8,960 becomes 5 x 1,792, 14B's 13,824 becomes 7 x 1,975.
FFN_COLUMN_BLOCK = 2048


class WanExportError(NumaovError):
    """The Wan export request is malformed (bad output directory and the like)."""


def _inputs(
    config, sizes: tuple[int, int, int, int, int], rng: np.random.Generator, timestep: str
) -> dict[str, np.ndarray]:
    """Random f32 model inputs for ``sizes`` = (batch, F', H', W', text length)."""
    batch, frames, height, width, text = sizes
    p_t, p_h, p_w = config.patch_size
    # Per-frame: every frame its own value, so a graph that mixed up or broadcast frames
    # (e.g. used frame 0's timestep for all) fails parity.
    t_shape = (batch,) if timestep == "scalar" else (batch, frames)
    return {
        "hidden_states": rng.standard_normal(
            (batch, config.in_channels, frames * p_t, height * p_h, width * p_w), dtype=np.float32
        ),
        # Timesteps as the sampler gives them: 1000 * sigma, anywhere in [0, 1000].
        "timestep": rng.uniform(0.0, 1000.0, size=t_shape).astype(np.float32),
        "encoder_hidden_states": rng.standard_normal(
            (batch, text, config.text_dim), dtype=np.float32
        ),
    }


def _dynamic_shapes(config, timestep: str) -> dict[str, dict[int, object]]:
    dim = torch.export.Dim
    batch = dim("batch", min=1, max=_MAX_BATCH)
    text = dim("text_length", min=1, max=_MAX_TEXT)
    video, patches = {}, {}
    for axis, name, patch in zip(
        (2, 3, 4), ("frame", "height", "width"), config.patch_size, strict=True
    ):
        patches[name] = dim(f"{name}_patches", min=1, max=_MAX_PATCHES)
        video[axis] = patches[name] if patch == 1 else patch * patches[name]
    return {
        "hidden_states": {0: batch, **video},
        # Per-frame timesteps [B, F']: F' is the video's frame axis after patching.
        "timestep": {0: batch} if timestep == "scalar" else {0: batch, 1: patches["frame"]},
        "encoder_hidden_states": {0: batch, 1: text},
    }


def check_timestep(timestep: str) -> str:
    if timestep not in TIMESTEP_KINDS:
        raise WanExportError(
            f"unknown timestep {timestep!r}; expected one of {', '.join(TIMESTEP_KINDS)} "
            "(per-frame for Wan 2.2 TI2V)",
            parameter="timestep",
        )
    return timestep


def export_wan(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    precision: str = "f32",
    lowering: str = "decomposed",
    progress: Callable[[str], None] | None = None,
    timestep: str = "scalar",
    force: bool = False,
    loras: Sequence[LoraSpec] = (),
    loras_2: Sequence[LoraSpec] = (),
    reuse: str | Path | None = None,
    sequence_parallel: Sequence[int] = (),
) -> ExportManifest:
    """Export the Wan checkpoint in ``checkpoint_dir`` to ``out_dir``; returns the manifest.

    ``timestep`` is ``"scalar"`` (``[batch]``) or ``"per-frame"`` (``[batch, frame_patches]``).
    ``force`` replaces an ``out_dir`` that holds something other than a numaov export.
    ``loras`` are merged into the transformer, ``loras_2`` into a pipeline's second expert
    (``LoraSpec``: a file and its scale), in order. ``reuse`` is an earlier export whose
    graphs are taken where nothing they come from changed (``exporter.reuse``).
    ``sequence_parallel`` adds, per transformer, a graph split over each of these rank counts
    (``exporter.wan_sequence_export``).

    Raises ``ParityError`` (``out_dir`` left as it was) when ONNX Runtime or OpenVINO differ
    from PyTorch beyond the tolerance of ``numaov.exporter.parity``.
    """
    report = progress or (lambda _msg: None)
    check_precision(precision)
    check_lowering(lowering)
    check_timestep(timestep)
    sequence_parallel = check_sequence_ranks(sequence_parallel, None, timestep)
    transformer = functools.partial(export_transformer, sequence_ranks=sequence_parallel)
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    # Fail before the (possibly long) model load, and before creating anything.
    if not checkpoint_dir.is_dir():
        raise WanExportError(
            f"checkpoint {str(checkpoint_dir)!r} is not a directory; expected a diffusers "
            "WanTransformer3DModel directory (config.json + diffusion_pytorch_model*.safetensors) "
            "or a diffusers Wan pipeline directory (model_index.json)",
            parameter="checkpoint",
        )
    reused = ComponentReuse(check_previous(reuse), report)
    if is_pipeline_dir(checkpoint_dir):
        index = read_model_index(checkpoint_dir)  # a missing component is named before any work
        if loras_2 and not has_second_expert(index):
            raise _no_second_expert(checkpoint_dir)
        merged = read_merged_loras(checkpoint_dir / TRANSFORMER_DIR, loras, report)
        merged_2 = read_merged_loras(checkpoint_dir / TRANSFORMER_2_DIR, loras_2, report,
                                     parameter="loras_2")
        # each transformer's heads and timestep kind, before the text encoder's export
        for name in [TRANSFORMER_DIR, *([TRANSFORMER_2_DIR] if has_second_expert(index) else [])]:
            check_transformer_split(checkpoint_dir / name, sequence_parallel,
                                    pipeline_timestep(index, timestep))
        with staged_output(out_dir, force) as staging:
            return export_pipeline_into(checkpoint_dir, staging, precision, lowering, timestep,
                                        report, transformer, loras=(merged, merged_2),
                                        reuse=reused)
    if loras_2:
        raise _no_second_expert(checkpoint_dir)
    check_transformer_split(checkpoint_dir, sequence_parallel, timestep)
    merged = read_merged_loras(checkpoint_dir, loras, report)
    with staged_output(out_dir, force) as staging:  # published when the block returns
        return transformer(checkpoint_dir, staging, precision, lowering, timestep, report,
                           loras=merged, reuse=reused, name="")


def export_transformer(
    checkpoint_dir: Path, out_dir: Path, precision: str, lowering: str, timestep: str,
    report: Callable[[str], None], loras: Sequence[WanLora], reuse: ComponentReuse,
    name: str, sequence_ranks: Sequence[int] = (),
) -> ExportManifest:
    """One transformer into ``out_dir`` (``name``: its directory in the export), or the same
    one taken from ``reuse``'s earlier export; ``sequence_ranks`` as ``export_wan`` checked
    them against its heads."""
    options = {"graph": "wan", "precision": precision, "lowering": lowering,
               "timestep": timestep,
               "loras": [{"xxh3_128": lora.digest, "scale": lora.scale} for lora in loras],
               **({"sequence_parallel": list(sequence_ranks)} if sequence_ranks else {})}
    return reuse.export(name, out_dir, checkpoint_dir, options, lambda: _export_into(
        checkpoint_dir, out_dir, precision, lowering, timestep, report, loras=loras,
        sequence_ranks=sequence_ranks),
        loras=[lora.record() for lora in loras])


def _no_second_expert(checkpoint_dir: Path) -> WanExportError:
    return WanExportError(
        f"{str(checkpoint_dir)!r} has no second transformer (transformer_2 with boundary_ratio, "
        "Wan 2.2 A14B) to merge LoRAs into; expected LoRAs for the transformer only",
        parameter="loras_2")


def read_merged_loras(transformer_dir: Path, specs: Sequence[LoraSpec],
                      report: Callable[[str], None], parameter: str = "loras") -> list[WanLora]:
    """Read ``specs`` through diffusers' Wan LoRA loader and check each against the shapes of
    the checkpoint in ``transformer_dir`` (its safetensors headers only), before any work;
    a refusal names ``parameter`` (``loras`` or ``loras_2``)."""
    from numaov.models.checkpoint import open_safetensors_checkpoint
    from numaov.models.wan.lora import read_lora
    from numaov.models.wan.transformer import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    if not specs:
        return []
    what = f"the transformer in {str(transformer_dir)!r}"
    shapes = open_safetensors_checkpoint(transformer_dir, WEIGHTS_NAME, WEIGHTS_INDEX_NAME,
                                         f"Wan checkpoint {str(transformer_dir)!r}").shapes()
    merged = []
    for spec in specs:
        try:
            lora = read_lora(spec)
            lora.check_fits(shapes, what)
        except LoraError as exc:
            exc.parameter = parameter
            raise
        report(f"LoRA {lora.path.name}: {len(lora.layers)} layers, scale {lora.scale:g}, "
               f"for {transformer_dir.name}")
        merged.append(lora)
    return merged


def load_for_export(checkpoint_dir: Path, precision: str,
                    loras: Sequence[WanLora] = ()) -> torch.nn.Module:
    """The transformer as the export traces it: its FFN in column parts (``FFN_COLUMN_BLOCK``)
    and, for a bf16 export, its weights held in bf16 as the IR stores them (LoRAs merged in
    f32 first) and widened to f32 where each is read (``compute_in_f32``). So no f32 copy of
    the weights is ever made, the ONNX graph carries them in bf16 behind a Cast, and the
    parity reference computes in f32 on the very values the IR holds."""
    from numaov.models.checkpoint import compute_in_f32
    from numaov.models.wan.transformer import WanTransformer

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = WanTransformer.from_pretrained(checkpoint_dir, dtype=dtype, loras=loras)
    model.split_ffn_columns(FFN_COLUMN_BLOCK)
    compute_in_f32(model)
    return model


def _export_into(
    checkpoint_dir: Path,
    out_dir: Path,
    precision: str,
    lowering: str,
    timestep: str,
    report: Callable[[str], None],
    loras: Sequence[WanLora] = (),
    sequence_ranks: Sequence[int] = (),
) -> ExportManifest:
    timings: dict[str, float] = {}

    start = time.perf_counter()
    report(f"loading Wan checkpoint {checkpoint_dir}"
           + (f" and merging {len(loras)} LoRA(s) in f32" if loras else ""))
    model = load_for_export(checkpoint_dir, precision, loras)
    model.block_outputs = True  # the step cache's parts, the parity's stages
    config = model.config
    output_names = [OUTPUT_NAME, *state_outputs(config.num_layers)]
    timings["load"] = time.perf_counter() - start

    start = time.perf_counter()
    example = _inputs(config, EXAMPLE_SIZES, np.random.default_rng(PARITY_SEED + 1), timestep)
    graph = export_onnx(
        model,
        (),
        {name: torch.from_numpy(array) for name, array in example.items()},
        _dynamic_shapes(config, timestep),
        out_dir / ONNX_NAME,
        lowering,
        report,
        output_names=output_names,
    )
    sequence_graphs = [
        export_sequence_onnx(model, ranks, out_dir, example, _dynamic_shapes(config, timestep),
                             ONNX_NAME, lowering, report)
        for ranks in sequence_ranks
    ]
    timings["onnx_export"] = time.perf_counter() - start

    # PyTorch's outputs first, then free the model: ONNX Runtime and OpenVINO each load a
    # copy of the weights, and three copies of a 14B model do not fit most machines.
    rng = np.random.default_rng(PARITY_SEED)
    input_sets = [_inputs(config, sizes, rng, timestep) for sizes in PARITY_SIZES]
    start = time.perf_counter()
    report("running PyTorch on the parity inputs")
    reference = torch_reference(model, input_sets)
    timings["torch_reference"] = time.perf_counter() - start
    del model
    release_freed_memory()

    start = time.perf_counter()
    xml_path = convert_to_ir(graph.path, out_dir / IR_NAME, precision, report,
                             keep_weight_casts=precision == "bf16", f32_inputs=("timestep",))
    timings["openvino_convert"] = time.perf_counter() - start

    start = time.perf_counter()
    # bf16: OpenVINO is judged block by block (check_stages), ONNX Runtime (f32) and an f32
    # export on the whole sample. The whole sample's bf16 error is kept, not judged: it grows
    # with the depth (the figures are in the manifest).
    staged = precision == "bf16"
    figures = check_parity(
        input_sets,
        reference,
        output_names,
        graph.path,
        xml_path,
        openvino_precision=INFERENCE_PRECISION[precision],
        progress=report,
        measured_outputs=[OUTPUT_NAME],
        judged_backends=("onnxruntime",) if staged else BACKENDS,
    )
    if staged:
        figures = judge(figures + check_stages(
            xml_path, INFERENCE_PRECISION[precision], input_sets, reference, output_names,
            block_states(config.num_layers), OUTPUT_NAME, report),
            "exported model does not match PyTorch block by block")
        report(summary(figures))
    timings["parity"] = time.perf_counter() - start

    write_reference_sample(
        out_dir / REFERENCE_SAMPLE_NAME, input_sets[0], {OUTPUT_NAME: reference[0][0]}
    )
    manifest = ExportManifest(
        kind="wan",
        config=config.to_dict(),
        inputs=graph.inputs,
        outputs=graph.outputs,
        precision=precision,
        inference_precision=INFERENCE_PRECISION[precision],
        lowering=lowering,
        timestep=timestep,
        ranks=[
            RankFiles(
                rank=0, onnx=ONNX_NAME, ir_xml=IR_NAME, ir_bin=xml_path.with_suffix(".bin").name
            )
        ],
        versions=library_versions(),
        parity=[f.as_dict() for f in figures],
        source_checkpoint=str(checkpoint_dir.resolve()),
        export_seconds={k: round(v, 3) for k, v in timings.items()},
        reference_sample=REFERENCE_SAMPLE_NAME,
        parity_attention=parity_attention(figures),
        loras=[lora.record() for lora in loras],
    )
    if sequence_graphs:
        start = time.perf_counter()
        for part in sequence_graphs:
            finish_sequence_graph(part, lambda onnx, xml: convert_to_ir(
                onnx, xml, precision, report, keep_weight_casts=precision == "bf16",
                f32_inputs=("timestep",)), xml_path,
                # and a video whose tokens no rank count divides
                [*input_sets, _inputs(config, PADDED_SIZES, rng, timestep)], manifest, report)
        timings["sequence_parallel"] = time.perf_counter() - start
    manifest.files = digest_export(out_dir)  # the sequence-parallel graphs' files included
    manifest.write_and_report(out_dir, timings, report)
    return manifest

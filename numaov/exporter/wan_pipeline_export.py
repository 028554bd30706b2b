"""Export a diffusers Wan pipeline directory: every component a graph with its own parity.

A diffusers pipeline directory (``model_index.json`` beside ``transformer/``, ``text_encoder/``,
``vae/``, ``tokenizer/``, ``scheduler/``) becomes one staged export:

- ``text_encoder/``: UMT5's encoder (``numaov.models.wan.components.TextEncoderGraph``);
- ``transformer/``: the DiT, exactly as ``export_wan`` exports a bare transformer directory;
  ``transformer_2/`` likewise for Wan 2.2 A14B's second expert (the pipeline's
  ``boundary_ratio`` stays in the model index, read by the runtime);
- ``vae_decoder/first_frame/`` and ``vae_decoder/next_frame/``: the VAE decoder's two loop
  bodies with their frame caches as inputs and outputs (``VaeFirstFrameGraph``,
  ``VaeNextFrameGraph``);
- ``vae_encoder/`` for image-to-video (Wan 2.2 TI2V's ``expand_timesteps``, and
  ``WanImageToVideoPipeline``): the encoder's first chunk, one image (``VaeImageEncoderGraph``);
  ``vae_encoder_next/`` beside it for a ``WanImageToVideoPipeline`` that concatenates the
  condition to the latents (Wan 2.1 / 2.2 I2V A14B, which encode the image followed by zero
  frames): every later chunk of 4 frames with the caches (``VaeNextFramesEncoderGraph``);
- ``tokenizer/``, ``scheduler/`` and ``model_index.json``, copied as they are;
- LoRAs (``export_wan``'s ``loras`` / ``loras_2``) merged into ``transformer/`` and
  ``transformer_2/`` before their export; each transformer's manifest lists its own, the
  pipeline's all of them with their ``component``;
- ``manifest.json`` of kind ``"wan-pipeline"`` naming the components (each subdirectory has
  its own manifest with inputs, parity figures and file digests) and, in ``config``, what the
  runtime needs from the pipeline: the model index and the VAE's latent statistics.

Each graph goes through the exporter's pieces: ``export_onnx`` (torch.export with dynamic axes),
PyTorch's outputs on the parity inputs, ``convert_to_ir`` and ``check_parity`` against
ONNX Runtime and OpenVINO at the export's precision, at shapes other than the example's.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from numaov import NumaovError
from numaov.exporter.onnx_export import export_onnx
from numaov.exporter.openvino_convert import INFERENCE_PRECISION, convert_to_ir
from numaov.exporter.output_dir import (
    digest_export,
    library_versions,
    write_reference_sample,
)
from numaov.exporter.parity import check_parity, parity_attention, torch_reference
from numaov.exporter.release import release_freed_memory
from numaov.exporter.reuse import ComponentReuse
from numaov.manifest import (
    IMAGE_TO_VIDEO_CLASS,
    PIPELINE_KIND,
    TEXT_ENCODER_KIND,
    VAE_ENCODER_KIND,
    VAE_ENCODER_NEXT_KIND,
    VAE_FIRST_FRAME_KIND,
    VAE_NEXT_FRAME_KIND,
    ExportManifest,
    RankFiles,
)
from numaov.models.wan.components import (
    GraphInputs,
    VaeFirstFrameGraph,
    VaeImageEncoderGraph,
    VaeNextFrameGraph,
    VaeNextFramesEncoderGraph,
    load_text_encoder,
    load_vae,
)

logger = logging.getLogger(__name__)

MODEL_INDEX_NAME = "model_index.json"
PIPELINE_CLASSES = ("WanPipeline", IMAGE_TO_VIDEO_CLASS)
# Directories copied into the export as they are (read by the runtime with their libraries).
COPIED = ("tokenizer", "scheduler")
TEXT_ENCODER_DIR = "text_encoder"
TRANSFORMER_DIR = "transformer"
TRANSFORMER_2_DIR = "transformer_2"  # Wan 2.2 A14B's low-noise expert
VAE_FIRST_FRAME_DIR = "vae_decoder/first_frame"
VAE_NEXT_FRAME_DIR = "vae_decoder/next_frame"
VAE_ENCODER_DIR = "vae_encoder"  # image conditioning (expand_timesteps and I2V pipelines)
VAE_ENCODER_NEXT_DIR = "vae_encoder_next"  # the later frames (I2V pipelines' condition video)
# Text: at least 2 tokens (torch.export specialises a length of 1; the runtime pads a 1-token
# batch with a masked pad token, which changes no real token's output).
_MAX_BATCH = 64
_MAX_TEXT = 4096
_MAX_LATENT = 1024
TEXT_EXAMPLE = (2, 7)
TEXT_PARITY = ((1, 5), (2, 13))
# Latent (batch, height, width): the example, and parity shapes differing on every axis.
VAE_EXAMPLE = (2, 6, 10)
VAE_PARITY = ((1, 4, 6), (3, 5, 3))
PARITY_SEED = 0
# The VAE encoder graphs are f32 whatever the export's precision: OpenVINO 2026.4's bf16
# inference (AVX512-BF16 / AMX) turns the encoder's first RMS norm (diffusers' F.normalize over
# conv_in's 96 channels at the published sizes; the convolution alone is right) into NaN and
# inf, so parity refused a bf16 encoder and with it the whole export; with the norms exported
# as one reduction and a product (models/wan/components._rms_norm) every output is still inf. The
# encoder runs once per video (benchmarks/RESULTS.md, "Wan 2.2 I2V's image conditioning").
ENCODER_PRECISION = "f32"
class PipelineExportError(NumaovError):
    """A pipeline directory that cannot be exported (a missing or unknown component)."""


def is_pipeline_dir(directory: Path) -> bool:
    return (directory / MODEL_INDEX_NAME).is_file()


def has_second_expert(index: dict[str, Any]) -> bool:
    entry = index.get(TRANSFORMER_2_DIR)
    return isinstance(entry, list) and bool(entry) and bool(entry[0])


def encodes_images(index: dict[str, Any]) -> bool:
    """Image-to-video: Wan 2.2 TI2V (``expand_timesteps``) or a ``WanImageToVideoPipeline``."""
    return bool(index.get("expand_timesteps")) or index.get("_class_name") == IMAGE_TO_VIDEO_CLASS


def concatenates_condition(index: dict[str, Any]) -> bool:
    """diffusers' ``WanImageToVideoPipeline`` without ``expand_timesteps`` (Wan 2.1 / 2.2 I2V
    A14B): the mask and the encoded condition video are channels of every model input."""
    return index.get("_class_name") == IMAGE_TO_VIDEO_CLASS and not index.get("expand_timesteps")


def read_model_index(directory: Path) -> dict[str, Any]:
    """``model_index.json``, checked: a Wan pipeline class and the components it needs."""
    path = directory / MODEL_INDEX_NAME
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PipelineExportError(f"cannot read {str(path)!r} as JSON ({exc})",
                                  parameter="checkpoint") from exc
    cls = index.get("_class_name") if isinstance(index, dict) else None
    if cls not in PIPELINE_CLASSES:
        raise PipelineExportError(
            f"{str(path)!r} describes a {cls!r}; expected one of {', '.join(PIPELINE_CLASSES)}",
            parameter="checkpoint",
        )
    for name in ("text_encoder", "tokenizer", "transformer", "vae", "scheduler"):
        entry = index.get(name)
        if not (isinstance(entry, list) and entry and entry[0]) or not (directory / name).is_dir():
            raise PipelineExportError(
                f"pipeline directory {str(directory)!r} has no {name!r} component; expected "
                f"{name}/ and its entry in {MODEL_INDEX_NAME}, as diffusers' save_pretrained "
                "writes them",
                parameter="checkpoint",
            )
    image_encoder = index.get("image_encoder")
    if isinstance(image_encoder, list) and any(image_encoder):
        raise PipelineExportError(
            f"{str(path)!r} names an image_encoder {image_encoder!r} (Wan 2.1 I2V's CLIP image "
            "embeddings), which numaov does not export; expected a pipeline without one, as "
            "Wan 2.2 I2V A14B's", parameter="checkpoint",
        )
    if concatenates_condition(index):
        _check_condition_channels(directory)
    if has_second_expert(index):
        if not (directory / TRANSFORMER_2_DIR).is_dir():
            raise PipelineExportError(
                f"{str(path)!r} names a transformer_2 but {str(directory)!r} has no "
                f"{TRANSFORMER_2_DIR}/; expected both experts of a Wan 2.2 pipeline",
                parameter="checkpoint",
            )
        if index.get("boundary_ratio") is None:
            raise PipelineExportError(
                f"{str(path)!r} has a transformer_2 but no boundary_ratio; expected the "
                "timestep ratio where the second expert takes over (Wan 2.2 A14B: 0.875)",
                parameter="checkpoint",
            )
    return index


def _check_condition_channels(directory: Path) -> None:
    """An I2V transformer takes the latents, the first-frame mask (one channel per frame the
    VAE folds into a latent frame) and the condition latents: in_channels = 2 z_dim + t."""
    configs = {}
    for name in ("transformer", "vae"):
        path = directory / name / "config.json"
        try:
            configs[name] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PipelineExportError(f"cannot read {str(path)!r} as JSON ({exc})",
                                      parameter="checkpoint") from exc
    vae, transformer = configs["vae"], configs["transformer"]
    z_dim, temporal = int(vae.get("z_dim", 16)), int(vae.get("scale_factor_temporal", 4))
    got = (transformer.get("in_channels"), transformer.get("out_channels"))
    if got != (2 * z_dim + temporal, z_dim):
        raise PipelineExportError(
            f"the image-to-video transformer in {str(directory / 'transformer')!r} has "
            f"in_channels, out_channels = {got[0]}, {got[1]}; expected "
            f"{2 * z_dim + temporal}, {z_dim} (the VAE's {z_dim} latent channels, {temporal} "
            f"mask channels and {z_dim} condition channels in, the latents' {z_dim} out)",
            parameter="checkpoint",
        )


def pipeline_timestep(index: dict[str, Any], timestep: str) -> str:
    """The timestep kind a pipeline's transformers are exported with: per frame for Wan 2.2
    TI2V (``expand_timesteps``: diffusers gives every video token its own timestep, a
    conditioned first frame's at 0; the transformer takes them per latent frame), else
    ``timestep``."""
    return "per-frame" if index.get("expand_timesteps") else timestep


def export_pipeline_into(
    pipeline_dir: Path,
    out_dir: Path,
    precision: str,
    lowering: str,
    timestep: str,
    report: Callable[[str], None],
    export_transformer: Callable[..., ExportManifest],
    loras: tuple[Sequence[Any], Sequence[Any]] = ((), ()),
    reuse: ComponentReuse | None = None,
) -> ExportManifest:
    """Export every component of ``pipeline_dir`` into the staging directory ``out_dir``;
    ``loras`` are the ``WanLora`` merged into the transformer and into ``transformer_2``;
    ``reuse`` takes the graphs an earlier export already holds (``exporter.reuse``)."""
    reuse = reuse or ComponentReuse(None, report)
    index = read_model_index(pipeline_dir)
    timestep = pipeline_timestep(index, timestep)
    start = time.perf_counter()
    timings: dict[str, float] = {}
    parts: list[ExportManifest] = []

    report("text encoder (UMT5)")
    parts.append(_export_text_encoder(pipeline_dir / "text_encoder", out_dir, precision,
                                      lowering, report, reuse))
    timings["text_encoder"] = time.perf_counter() - start

    report("transformer")
    start = time.perf_counter()
    (out_dir / TRANSFORMER_DIR).mkdir()
    parts.append(export_transformer(pipeline_dir / "transformer", out_dir / TRANSFORMER_DIR,
                                    precision, lowering, timestep, report, loras=loras[0],
                                    reuse=reuse, name=TRANSFORMER_DIR))
    timings["transformer"] = time.perf_counter() - start
    experts = [TRANSFORMER_DIR]
    if has_second_expert(index):
        report("transformer_2 (the low-noise expert)")
        start = time.perf_counter()
        (out_dir / TRANSFORMER_2_DIR).mkdir()
        parts.append(export_transformer(pipeline_dir / TRANSFORMER_2_DIR,
                                        out_dir / TRANSFORMER_2_DIR, precision, lowering,
                                        timestep, report, loras=loras[1], reuse=reuse,
                                        name=TRANSFORMER_2_DIR))
        timings["transformer_2"] = time.perf_counter() - start
        experts.append(TRANSFORMER_2_DIR)

    report("VAE decoder")
    start = time.perf_counter()
    vae = load_vae(pipeline_dir / "vae")
    vae_config = dict(vae.config)
    parts += _export_vae_decoder(vae, pipeline_dir / "vae", out_dir, precision, lowering, report,
                                 reuse)
    vae_components = [VAE_FIRST_FRAME_DIR, VAE_NEXT_FRAME_DIR]
    if encodes_images(index):
        # Wan 2.2 TI2V conditions on an image put in the first latent frame; Wan 2.2 I2V on
        # the image followed by zero frames, encoded in chunks of 4 after the first.
        report("VAE encoder")
        encoder_parts = _export_vae_encoder(vae, pipeline_dir / "vae", out_dir,
                                            ENCODER_PRECISION, lowering, report,
                                            concatenates_condition(index), reuse)
        parts += encoder_parts
        vae_components += [VAE_ENCODER_DIR, VAE_ENCODER_NEXT_DIR][: len(encoder_parts)]
    del vae
    release_freed_memory()
    timings["vae_decoder"] = time.perf_counter() - start

    for name in COPIED:
        shutil.copytree(pipeline_dir / name, out_dir / name)
    shutil.copy2(pipeline_dir / MODEL_INDEX_NAME, out_dir / MODEL_INDEX_NAME)
    components = [TEXT_ENCODER_DIR, *experts, *vae_components]
    files = {name: digest for name, digest in digest_export(out_dir).items()
             if not any(name.startswith(f"{c}/") for c in components)}
    manifest = ExportManifest(
        kind=PIPELINE_KIND,
        config={
            "model_index": index,
            "vae": {key: _plain(vae_config[key]) for key in
                    ("z_dim", "latents_mean", "latents_std", "scale_factor_temporal",
                     "scale_factor_spatial", "base_dim", "dim_mult", "patch_size",
                     "is_residual") if key in vae_config},
        },
        inputs=[],
        outputs=[],
        precision=precision,
        inference_precision=INFERENCE_PRECISION[precision],
        lowering=lowering,
        ranks=[],
        versions=library_versions(),
        parity=[dict(figure, component=c) for c, part in zip(components, parts, strict=True)
                for figure in part.parity],
        source_checkpoint=str(pipeline_dir.resolve()),
        export_seconds={k: round(v, 3) for k, v in timings.items()},
        components=components,
        files=files,
        loras=[dict(lora, component=c) for c, part in zip(components, parts, strict=True)
               for lora in part.loras],
    )
    manifest.write_and_report(out_dir, timings, report)
    return manifest


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# -- one component ----------------------------------------------------------------------------


def _export_graph(
    load: Callable[[], torch.nn.Module],
    kind: str,
    example: dict[str, Any],
    dynamic_shapes: dict[str, Any],
    input_sets: Sequence[dict[str, np.ndarray]] | Callable[[], Sequence[dict[str, np.ndarray]]],
    output_names: list[str],
    export_dir: Path,
    name: str,
    precision: str,
    lowering: str,
    report: Callable[[str], None],
    source: Path,
    config: dict[str, Any],
    reuse: ComponentReuse,
    narrow_weights: bool = False,
) -> ExportManifest:
    """The graph ``name`` (its directory under ``export_dir``), taken from ``reuse``'s earlier
    export when the same, else exported: ``load()``'s module through export_onnx -> PyTorch
    reference -> IR -> parity -> ``manifest.json``; ``narrow_weights``: the module holds bf16
    weights widened where read (``compute_in_f32``), which the IR stores as they are
    (``convert_to_ir(keep_weight_casts=True)``). The module is let go once PyTorch's outputs
    are in, before OpenVINO loads its own copy (a caller with a big one keeps no reference).
    ``input_sets`` may be a callable, run only when the graph is exported."""
    out_dir = export_dir / name
    options = {"graph": kind, "precision": precision, "lowering": lowering}
    return reuse.export(name, out_dir, source, options, lambda: _export_new_graph(
        load(), kind, example, dynamic_shapes,
        input_sets() if callable(input_sets) else input_sets, output_names, out_dir,
        precision, lowering, report, source, config, narrow_weights))


def _export_new_graph(
    module: torch.nn.Module,
    kind: str,
    example: dict[str, Any],
    dynamic_shapes: dict[str, Any],
    input_sets: Sequence[dict[str, np.ndarray]],
    output_names: list[str],
    out_dir: Path,
    precision: str,
    lowering: str,
    report: Callable[[str], None],
    source: Path,
    config: dict[str, Any],
    narrow_weights: bool,
) -> ExportManifest:
    out_dir.mkdir(parents=True)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    graph = export_onnx(module, (), example, dynamic_shapes, out_dir / "model.onnx", lowering,
                        report, output_names=output_names)
    timings["onnx_export"] = time.perf_counter() - start
    start = time.perf_counter()
    reference = torch_reference(GraphInputs(module), input_sets)
    timings["torch_reference"] = time.perf_counter() - start
    del module
    release_freed_memory()
    start = time.perf_counter()
    xml_path = convert_to_ir(graph.path, out_dir / "model.xml", precision, report,
                             keep_weight_casts=narrow_weights)
    timings["openvino_convert"] = time.perf_counter() - start
    start = time.perf_counter()
    figures = check_parity(input_sets, reference, output_names, graph.path, xml_path,
                           openvino_precision=INFERENCE_PRECISION[precision], progress=report)
    timings["parity"] = time.perf_counter() - start
    write_reference_sample(out_dir / "reference_sample.npz", input_sets[0],
                           dict(zip(output_names, reference[0], strict=True)))
    manifest = ExportManifest(
        kind=kind,
        config=config,
        inputs=graph.inputs,
        outputs=graph.outputs,
        precision=precision,
        inference_precision=INFERENCE_PRECISION[precision],
        lowering=lowering,
        ranks=[RankFiles(rank=0, onnx="model.onnx", ir_xml="model.xml",
                         ir_bin=xml_path.with_suffix(".bin").name)],
        versions=library_versions(),
        parity=[f.as_dict() for f in figures],
        source_checkpoint=str(source.resolve()),
        export_seconds={k: round(v, 3) for k, v in timings.items()},
        reference_sample="reference_sample.npz",
        parity_attention=parity_attention(figures),
        files=digest_export(out_dir),
    )
    manifest.write_and_report(out_dir, timings, report)
    return manifest


def _export_text_encoder(
    source: Path, export_dir: Path, precision: str, lowering: str,
    report: Callable[[str], None], reuse: ComponentReuse,
) -> ExportManifest:
    narrow = precision == "bf16"
    config = _read_config(source)
    vocab = int(config["vocab_size"])
    rng = np.random.default_rng(PARITY_SEED)

    def inputs(batch: int, length: int) -> dict[str, np.ndarray]:
        mask = np.ones((batch, length), dtype=np.int64)
        mask[-1, length // 2:] = 0  # the shorter prompt of a batch is padded and masked
        return {"input_ids": rng.integers(0, vocab, (batch, length), dtype=np.int64),
                "attention_mask": mask}

    dim = torch.export.Dim
    batch = dim("batch", min=1, max=_MAX_BATCH)
    text = dim("text_length", min=2, max=_MAX_TEXT)
    example = {k: torch.from_numpy(v) for k, v in inputs(*TEXT_EXAMPLE).items()}
    return _export_graph(
        lambda: load_text_encoder(source, torch.bfloat16 if narrow else torch.float32),
        TEXT_ENCODER_KIND, example,
        {"input_ids": {0: batch, 1: text}, "attention_mask": {0: batch, 1: text}},
        [inputs(*sizes) for sizes in TEXT_PARITY], ["last_hidden_state"],
        export_dir, TEXT_ENCODER_DIR, precision, lowering, report, source,
        {"d_model": int(config["d_model"]), "vocab_size": vocab}, reuse, narrow_weights=narrow,
    )


def _read_config(directory: Path) -> dict[str, Any]:
    """The text encoder's config as transformers reads it (its defaults filled in)."""
    from transformers import UMT5Config

    try:
        return UMT5Config.from_pretrained(str(directory)).to_dict()
    except (OSError, ValueError) as exc:
        raise PipelineExportError(
            f"cannot read {str(directory / 'config.json')!r} as a UMT5 config ({exc})",
            parameter="checkpoint") from exc


def _vae_axes() -> Callable[[Sequence[int]], dict[int, Any]]:
    """The dynamic axes of a VAE graph's 5-D tensors (latents, pixels, caches) from their
    example shape: the batch, and height and width as multiples of the latent's, the factor
    read off the example (``VAE_EXAMPLE``'s latent height and width)."""
    dim = torch.export.Dim
    batch = dim("batch", min=1, max=_MAX_BATCH)
    height = dim("latent_height", min=1, max=_MAX_LATENT)
    width = dim("latent_width", min=1, max=_MAX_LATENT)
    _, h0, w0 = VAE_EXAMPLE

    def axes(shape: Sequence[int]) -> dict[int, Any]:
        fh, fw = shape[3] // h0, shape[4] // w0
        return {0: batch, 3: height if fh == 1 else fh * height,
                4: width if fw == 1 else fw * width}

    return axes


def _export_vae_decoder(
    vae: torch.nn.Module, source: Path, out_dir: Path, precision: str, lowering: str,
    report: Callable[[str], None], reuse: ComponentReuse,
) -> list[ExportManifest]:
    z_dim = int(vae.config.z_dim)
    rng = np.random.default_rng(PARITY_SEED)
    first, following = VaeFirstFrameGraph(vae).eval(), VaeNextFrameGraph(vae).eval()

    def latents(batch: int, height: int, width: int) -> np.ndarray:
        return rng.standard_normal((batch, z_dim, 1, height, width), dtype=np.float32)

    axes = _vae_axes()
    _, h0, _ = VAE_EXAMPLE

    example = torch.from_numpy(latents(*VAE_EXAMPLE))
    slots = first.cache_slots(example)
    cache_names = [f"cache_{i}" for i in range(len(slots))]
    # scale_factor_spatial, patch_size and scale_factor_temporal: the runtime's VaeGeometry
    # (Wan 2.2's VAE decodes to 2x2 patches, unpatchified after tiles are blended, as diffusers
    # does; the built-in digits-wan's VAE is 4x spatial).
    config = {"z_dim": z_dim, "cache_slots": len(slots),
              "spatial_factors": [int(c.shape[3]) // h0 for c in slots],
              "scale_factor_spatial": int(vae.config.scale_factor_spatial or 8),
              "patch_size": int(vae.config.patch_size or 1),
              "scale_factor_temporal": int(vae.config.scale_factor_temporal or 4)}
    manifests = []

    report("VAE decoder, first frame")
    first_sets = [{"latents": latents(*sizes)} for sizes in VAE_PARITY]
    manifests.append(_export_graph(
        lambda: first, VAE_FIRST_FRAME_KIND, {"latents": example},
        {"latents": axes(example.shape)}, first_sets, ["frames", *cache_names], out_dir,
        VAE_FIRST_FRAME_DIR, precision, lowering, report, source, config, reuse,
    ))

    report("VAE decoder, next frames")
    next_latents = [latents(*feeds["latents"].shape[:1], *feeds["latents"].shape[3:])
                    for feeds in first_sets]

    def next_sets() -> list[dict[str, np.ndarray]]:
        # Real caches (the first frame's), so parity runs on the values the loop passes.
        return [{"latents": following_latents,
                 **{f"caches_{i}": c.numpy() for i, c in
                    enumerate(first.cache_slots(torch.from_numpy(feeds["latents"])))}}
                for feeds, following_latents in zip(first_sets, next_latents, strict=True)]

    manifests.append(_export_graph(
        lambda: following, VAE_NEXT_FRAME_KIND, {"latents": example, "caches": slots},
        {"latents": axes(example.shape), "caches": [axes(c.shape) for c in slots]},
        next_sets, ["frames", *cache_names], out_dir, VAE_NEXT_FRAME_DIR, precision,
        lowering, report, source, config, reuse,
    ))
    return manifests


def _export_vae_encoder(
    vae: torch.nn.Module, source: Path, out_dir: Path, precision: str, lowering: str,
    report: Callable[[str], None], next_frames: bool, reuse: ComponentReuse,
) -> list[ExportManifest]:
    """The encoder on one image ``[B, 3, 1, s*h, s*w]`` (``s`` the VAE's spatial factor) into
    ``vae_encoder/``; with ``next_frames`` also on each later chunk ``[B, 3, 4, s*h, s*w]``
    into ``vae_encoder_next/``, its caches from the first (as the decoder's two graphs)."""
    scale = int(vae.config.scale_factor_spatial or 8)
    rng = np.random.default_rng(PARITY_SEED)

    def video(batch: int, height: int, width: int, frames: int = 1) -> np.ndarray:
        pixels = rng.uniform(-1.0, 1.0, (batch, 3, frames, scale * height, scale * width))
        return pixels.astype(np.float32)

    axes = _vae_axes()
    _, h0, _ = VAE_EXAMPLE

    first = VaeImageEncoderGraph(vae).eval()
    example = torch.from_numpy(video(*VAE_EXAMPLE))
    slots = first.cache_slots(example)
    cache_names = [f"cache_{i}" for i in range(len(slots))]
    # spatial_factors: each cache's size in latents, for the runtime's memory estimate.
    config = {"z_dim": int(vae.config.z_dim), "scale_factor_spatial": scale,
              "cache_slots": len(slots),
              "spatial_factors": [int(c.shape[3]) // h0 for c in slots]}
    report("VAE encoder, first frame")
    first_sets = [{"image": video(*sizes)} for sizes in VAE_PARITY]
    manifests = [_export_graph(
        lambda: first, VAE_ENCODER_KIND, {"image": example}, {"image": axes(example.shape)},
        first_sets, ["latents", *cache_names], out_dir, VAE_ENCODER_DIR, precision, lowering,
        report, source, config, reuse,
    )]
    if not next_frames:
        return manifests

    report("VAE encoder, next frames")
    chunk = 4  # video frames per later chunk: the encoder's two 2x temporal downsamplers
    next_videos = [video(f["image"].shape[0], f["image"].shape[3] // scale,
                         f["image"].shape[4] // scale, chunk) for f in first_sets]

    def next_sets() -> list[dict[str, np.ndarray]]:
        # Real caches (the first chunk's), so parity runs on the values the loop passes.
        return [{"video": following,
                 **{f"caches_{i}": c.numpy() for i, c in
                    enumerate(first.cache_slots(torch.from_numpy(feeds["image"])))}}
                for feeds, following in zip(first_sets, next_videos, strict=True)]

    example_next = torch.from_numpy(video(*VAE_EXAMPLE, chunk))
    manifests.append(_export_graph(
        lambda: VaeNextFramesEncoderGraph(vae).eval(), VAE_ENCODER_NEXT_KIND,
        {"video": example_next, "caches": slots},
        {"video": axes(example_next.shape), "caches": [axes(c.shape) for c in slots]},
        next_sets, ["latents", *cache_names], out_dir, VAE_ENCODER_NEXT_DIR, precision,
        lowering, report, source, config, reuse,
    ))
    return manifests

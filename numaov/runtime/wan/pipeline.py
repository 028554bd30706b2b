"""Wan text-to-video (and image-to-video): a prompt in, a video file out, every model on the
chosen backend.

The pipeline is diffusers' ``WanPipeline`` on an export of a pipeline directory
(``numaov export wan --checkpoint PIPELINE_DIR``, manifest kind ``"wan-pipeline"``):

1. **Tokenize** with the exported ``tokenizer/`` (transformers ``AutoTokenizer``, as diffusers
   loads it), after diffusers' own ``prompt_clean``. A prompt longer than the pipeline's
   ``MAX_TEXT_TOKENS`` (512, WanPipeline's ``max_sequence_length``) is refused, not truncated.
2. **Encode** prompt and negative prompt in one batch on the text encoder graph, padded to
   the longer one with the mask off (padding changes no real token's output), then each
   embedding is cut at its own length and zero-padded to 512 tokens, as diffusers does.
3. **Denoise** with the sampling loop of ``sampler`` (one worker, or workers splitting the
   guidance branches, the tokens or both: ``parallel``; one branch per step at guidance 1),
   stepped by diffusers' scheduler built from the exported
   ``scheduler/scheduler_config.json``, or by the request's ``sampler`` / ``shift``
   (``schedules.scheduler_config``: Euler or UniPC, as distilled LoRAs prescribe).
4. **Decode** with the VAE decoder's two graphs, one latent frame at a time with their caches
   (``numaov.models.wan.components``), clamp to [-1, 1] and map to [0, 1] frames as diffusers'
   ``VideoProcessor`` does; then write the file (``video_output``).

Everything is checked before any model is loaded: the request, the output path, the prompt
lengths and a memory estimate (transformer weights and activations, latents, VAE caches and
the decoded video) against the memory available.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError, exception_text
from numaov.manifest import (
    IMAGE_TO_VIDEO_CLASS,
    OPTIONAL_COMPONENTS,
    PIPELINE_KIND,
    WAN_COMPONENTS,
)
from numaov.runtime.manifest_reader import ModelDirError, ModelManifest, read_manifest
from numaov.runtime.wan.graph_runner import GraphRunner
from numaov.runtime.wan.image_condition import ImageEncoder
from numaov.runtime.wan.image_input import image_pixels
from numaov.runtime.wan.memory import (
    MemoryEstimate,
    check_memory,
    estimate_memory,
    held_line,
    resident_bytes,
)
from numaov.runtime.wan.request import (
    SamplerInputError,
    WanSampleRequest,
    condition_channels,
    latent_shape,
)
from numaov.runtime.wan.sampler import (
    Progress,
    SampleResult,
    check_split_graphs,
    denoise,
    timestep_layout,
    validate_request,
    worker_plan,
)
from numaov.runtime.wan.schedules import make_schedule, scheduler_config
from numaov.runtime.wan.vae import (
    VaeDecoder,
    VaeGeometry,
    VaeTiling,
    decode_tiles_on_workers,
    decode_video,
    to_frames,
    vae_memory,
)
from numaov.runtime.wan.video_output import (
    DEFAULT_FPS,
    LATENTS_FORMAT,
    output_format,
    write_video,
)

logger = logging.getLogger(__name__)

MAX_TEXT_TOKENS = 512  # WanPipeline's max_sequence_length: the embeddings' length
TEXT_ENCODER = "text_encoder"
TRANSFORMER = "transformer"
TRANSFORMER_2 = "transformer_2"  # optional: Wan 2.2 A14B's low-noise expert
VAE_FIRST_FRAME = "vae_decoder/first_frame"
VAE_NEXT_FRAME = "vae_decoder/next_frame"
VAE_ENCODER = "vae_encoder"  # optional: image conditioning (Wan 2.2 TI2V and I2V)
VAE_ENCODER_NEXT = "vae_encoder_next"  # optional: the condition video's later frames (I2V)


class PromptError(NumaovError):
    """A prompt the text encoder cannot take."""


# What an export does with an image (the video's first frame): the answers of
# ImageRule.problem, one rule for run_wan_pipeline and for the service's input_reference.
IMAGE_NEEDED = "needed"  # an image-to-video export (no text-only mode) without an image
IMAGE_REFUSED = "refused"  # an image for an export with no image conditioning
IMAGE_INCOMPLETE = "incomplete"  # an image for an image-to-video export missing an encoder


@dataclass(frozen=True)
class ImageRule:
    """Which exports take an image: those with a VAE encoder (Wan 2.2 TI2V, and exports of
    ``WanImageToVideoPipeline`` directories, which need one); an export whose transformer
    takes condition channels (I2V) needs both encoder graphs."""

    needs: bool
    takes: bool
    missing: tuple[str, ...]  # the encoder graphs an I2V export lacks (re-export it)

    def problem(self, has_image: bool) -> str | None:
        """``IMAGE_NEEDED``, ``IMAGE_INCOMPLETE``, ``IMAGE_REFUSED``, or None: fine."""
        if not has_image:
            return IMAGE_NEEDED if self.needs else None
        if self.missing:
            return IMAGE_INCOMPLETE
        return None if self.takes else IMAGE_REFUSED


@dataclass(frozen=True)
class WanPipelineExport:
    """An exported pipeline directory: its manifest and every component's."""

    directory: Path
    record: Any
    components: dict[str, ModelManifest]

    @property
    def experts(self) -> list[ModelManifest]:
        """The transformer, and Wan 2.2's second expert when there is one."""
        return [self.components[n] for n in (TRANSFORMER, TRANSFORMER_2) if n in self.components]

    def boundary_timestep(self, scheduler: dict[str, Any]) -> float | None:
        """diffusers' ``boundary_ratio * num_train_timesteps`` for two experts, else None."""
        ratio = self.record.config.get("model_index", {}).get("boundary_ratio")
        if ratio is None or TRANSFORMER_2 not in self.components:
            return None
        return float(ratio) * float(scheduler.get("num_train_timesteps", 1000))

    @property
    def needs_image(self) -> bool:
        """diffusers' ``WanImageToVideoPipeline`` (Wan 2.2 I2V A14B) has no text-only mode."""
        return self.record.config.get("model_index", {}).get("_class_name") == IMAGE_TO_VIDEO_CLASS

    @property
    def image_rule(self) -> ImageRule:
        missing = (tuple(n for n in (VAE_ENCODER, VAE_ENCODER_NEXT) if n not in self.components)
                   if self.condition_channels else ())
        return ImageRule(self.needs_image, VAE_ENCODER in self.components, missing)

    @property
    def condition_channels(self) -> int:
        """Channels the transformer takes beside the latents (Wan 2.2 I2V: 20, the mask and
        the condition video; 0 for text to video and TI2V)."""
        return condition_channels(self.components[TRANSFORMER].config)

    @property
    def scheduler_config(self) -> dict[str, Any]:
        import json

        path = self.directory / "scheduler" / "scheduler_config.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelDirError(f"cannot read the scheduler config {str(path)!r} ({exc})") from exc


def read_pipeline(model_dir: str | Path) -> WanPipelineExport:
    """Read and check a pipeline export and each of its components' manifests."""
    top = read_manifest(model_dir, expected_kind=PIPELINE_KIND)
    components = {}
    for name, kind in WAN_COMPONENTS.items():
        if name not in top.record.components:
            if name in OPTIONAL_COMPONENTS:
                continue
            raise ModelDirError(
                f"pipeline export {str(top.directory)!r} has no {name!r} component; expected "
                f"{', '.join(WAN_COMPONENTS)}: re-export the pipeline directory"
            )
        components[name] = read_manifest(top.directory / name, expected_kind=kind)
    return WanPipelineExport(directory=top.directory, record=top.record, components=components)


# -- text -------------------------------------------------------------------------------------


def tokenize(tokenizer_dir: Path, prompts: dict[str, str]) -> tuple[dict[str, list[int]], int]:
    """Token ids of each prompt (keyed by the parameter that gave it), as WanPipeline
    tokenizes them, and the pad token's id; a prompt over ``MAX_TEXT_TOKENS`` tokens is
    refused."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise ModelDirError(f"the tokenizer in {str(tokenizer_dir)!r} cannot be read: "
                            f"{exception_text(exc, 300)}; "
                            "expected the pipeline's tokenizer as exported") from None
    ids = {}
    for parameter, prompt in prompts.items():
        if not isinstance(prompt, str):
            raise PromptError(f"{parameter}={prompt!r}; expected text", parameter=parameter)
        # verbose=False: the length is checked here, in one line, instead of a warning.
        tokens = tokenizer(prompt_clean(prompt), add_special_tokens=True, verbose=False)["input_ids"]
        if len(tokens) > MAX_TEXT_TOKENS:
            raise PromptError(
                f"the {parameter.replace('_', ' ')} is {len(tokens)} tokens; the text encoder "
                f"takes at most {MAX_TEXT_TOKENS} (Wan's max_sequence_length): expected a "
                "shorter prompt", parameter=parameter,
            )
        ids[parameter] = list(tokens)
    pad = tokenizer.pad_token_id
    return ids, int(pad) if pad is not None else 0


def encode(runner: GraphRunner, token_ids: list[list[int]], pad_id: int) -> list[np.ndarray]:
    """``[MAX_TEXT_TOKENS, D]`` f32 embeddings per prompt: its tokens' outputs, then zeros."""
    length = max(2, *(len(t) for t in token_ids))  # the graph takes 2 tokens or more
    ids = np.full((len(token_ids), length), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, tokens in enumerate(token_ids):
        ids[i, : len(tokens)], mask[i, : len(tokens)] = tokens, 1
    (hidden,) = runner({"input_ids": ids, "attention_mask": mask})
    out = []
    for i, tokens in enumerate(token_ids):
        embedding = np.zeros((MAX_TEXT_TOKENS, hidden.shape[-1]), dtype=np.float32)
        embedding[: len(tokens)] = hidden[i, : len(tokens)]
        out.append(embedding)
    return out


# -- the pipeline -----------------------------------------------------------------------------


def _conditioning_image(pipeline: WanPipelineExport, image: str | Path | np.ndarray | None,
                        request: WanSampleRequest) -> np.ndarray | None:
    """The image's pixels (None without one), after checking the export's image rule."""
    rule = pipeline.image_rule
    problem = rule.problem(image is not None)
    if problem == IMAGE_NEEDED:
        raise SamplerInputError(
            f"the pipeline in {str(pipeline.directory)!r} is image-to-video "
            f"({IMAGE_TO_VIDEO_CLASS}): expected an image, the video's first frame",
            parameter="image")
    if problem == IMAGE_INCOMPLETE:
        raise SamplerInputError(
            f"the image-to-video pipeline in {str(pipeline.directory)!r} has no "
            f"{' or '.join(map(repr, rule.missing))} component (the VAE encoder its "
            f"transformer's {pipeline.condition_channels} condition channels are made with); "
            f"expected both {VAE_ENCODER} and {VAE_ENCODER_NEXT}: re-export the pipeline "
            "directory", parameter="image")
    if problem == IMAGE_REFUSED:
        shown = "an image array" if isinstance(image, np.ndarray) else f"image={str(image)!r}"
        raise SamplerInputError(
            f"{shown}, but the pipeline in {str(pipeline.directory)!r} has no "
            "image conditioning (no vae_encoder component: exports of Wan 2.2 TI2V pipelines, "
            "with expand_timesteps, and of WanImageToVideoPipeline directories have one); "
            "expected no image", parameter="image")
    return None if image is None else image_pixels(image, request.height, request.width)


@dataclass
class VideoResult:
    sample: SampleResult
    frames: np.ndarray | None
    seconds: dict[str, float]

    def summary(self, out: str | Path) -> str:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        what = (f"{self.frames.shape[0]} frames of {self.frames.shape[2]}x{self.frames.shape[1]}"
                if self.frames is not None else f"latents {list(self.sample.latents.shape)}")
        return (f"wrote {out}: {what} on {self.sample.backend} with {self.sample.workers} "
                f"worker(s) in {sum(self.seconds.values()):.2f} s ({parts}"
                f"{self.sample.cached()})")


def estimate_pipeline_memory(
    pipeline: WanPipelineExport, shape: Sequence[int], workers: int, branches: int, *,
    decode: bool = True, tiling: VaeTiling | None = None, conditioned: bool = False,
) -> MemoryEstimate:
    """What a run of ``shape`` latents holds (``run_wan_pipeline`` checks it; the service
    admits a job by it): the transformers' weights and activations, the latents and, with
    ``decode``, the VAE decoder's caches, working memory and the decoded video; with
    ``conditioned`` (an image on an export whose transformers take condition channels), the
    VAE encoder's over the condition video (its chunks come and go)."""
    extra = vae_memory(pipeline.components[VAE_NEXT_FRAME], shape, tiling) if decode else {}
    if conditioned and pipeline.condition_channels:
        encoder = vae_memory(pipeline.components[VAE_ENCODER_NEXT], shape)
        extra["vae_encoder"] = encoder["vae_caches"] + encoder["vae_work"]
    return estimate_memory(pipeline.experts, shape, MAX_TEXT_TOKENS, workers, extra,
                           branches=branches)


def run_wan_pipeline(
    model_dir: str | Path,
    request: WanSampleRequest,
    prompt: str,
    out: str | Path | None,
    *,
    negative_prompt: str = "",
    backend: str = "openvino",
    workers: int = 1,
    parallel: str | None = None,
    fps: int = DEFAULT_FPS,
    vae_tiling: VaeTiling | None = None,
    image: str | Path | np.ndarray | None = None,
    progress: Progress = None,
) -> VideoResult:
    """Text to video with an exported pipeline; writes ``out`` by its extension (``.npy``:
    the final latents, without decoding), or, with ``out`` None, writes nothing: the frames
    are the result's (the service encodes them itself, ``video_output.encode_video``).

    ``image`` (a file of the video's size, or the array ``image_input.read_image`` made of
    one) conditions the video on it as its first frame, as
    diffusers' ``WanImageToVideoPipeline`` does with ``expand_timesteps`` (Wan 2.2 TI2V): the
    exported VAE encoder's latents are the first latent frame at every step, at timestep 0;
    or, for an export of a ``WanImageToVideoPipeline`` directory (Wan 2.2 I2V A14B, which
    needs one), as that pipeline does without it: the image and zero frames encoded, with the
    first-frame mask, are condition channels of every model input
    (``runtime/wan/image_condition.py``).

    ``workers`` > 1 split the sampling as ``parallel`` says (``runtime/wan/sampler.run_wan``)
    and, with ``vae_tiling`` (diffusers' tiled VAE decoding), the tiles too, tile ``i`` on
    worker ``i % workers``."""
    report = progress or (lambda _msg: None)
    split = validate_request(request, backend, workers, parallel)
    if request.unguided and negative_prompt:
        raise PromptError(
            f"negative prompt {negative_prompt[:40]!r} with guidance 1, which runs no "
            "unconditional branch; expected no negative prompt (or guidance > 1)",
            parameter="negative_prompt")
    if vae_tiling is not None:
        vae_tiling.check()
    plan = worker_plan(split)
    kind = None if out is None else output_format(out)
    pipeline = read_pipeline(model_dir)
    check_split_graphs(pipeline.experts, split)
    scheduler = scheduler_config(request.sampler, request.shift, pipeline.scheduler_config)
    boundary = pipeline.boundary_timestep(scheduler)
    if request.guidance_2 is not None and boundary is None:
        raise SamplerInputError(
            f"guidance_2={request.guidance_2} is the second expert's guidance, but the pipeline "
            f"in {str(pipeline.directory)!r} has one transformer: expected no guidance_2",
            parameter="guidance_2",
        )
    request = dataclasses.replace(request, scheduler=scheduler, boundary_timestep=boundary)
    make_schedule(request)  # a scheduler config that cannot step is refused before any loading
    if request.cache is not None:
        from numaov.runtime.wan.sampler import expert_steps
        from numaov.runtime.wan.step_cache import check_cache_export

        for expert, steps in zip(pipeline.experts, expert_steps(request), strict=True):
            check_cache_export(expert, request.cache, steps)
    transformer = pipeline.components[TRANSFORMER]
    geometry = VaeGeometry.of(pipeline.components[VAE_FIRST_FRAME])
    shape = latent_shape(transformer.config, request.frames, request.height, request.width,
                         geometry.spatial, geometry.temporal)
    pixels = _conditioning_image(pipeline, image, request)
    token_ids, pad_id = tokenize(pipeline.directory / "tokenizer",
                         {"prompt": prompt, "negative_prompt": negative_prompt})
    estimate = estimate_pipeline_memory(pipeline, shape, workers, request.branches,
                                        decode=kind != LATENTS_FORMAT, tiling=vae_tiling,
                                        conditioned=pixels is not None)
    check_memory(estimate)
    report(f"{estimate.describe()}")
    # Loading and compiling ("load") apart from each model's compute.
    seconds: dict[str, float] = {"load": 0.0}

    start = time.perf_counter()
    before = resident_bytes()
    encoder = GraphRunner(pipeline.components[TEXT_ENCODER], backend)
    seconds["load"] += time.perf_counter() - start
    start = time.perf_counter()
    if request.unguided:  # no unconditional branch: the negative prompt is not encoded
        (text,), negative = encode(encoder, [token_ids["prompt"]], pad_id), None
    else:
        text, negative = encode(encoder, [token_ids["prompt"], token_ids["negative_prompt"]],
                                pad_id)
    report(held_line("the text encoder", before, [pipeline.components[TEXT_ENCODER]]))
    del encoder
    seconds["text_encoder"] = time.perf_counter() - start
    report(f"encoded the prompts in {seconds['text_encoder']:.2f} s")

    condition = None
    if pixels is not None:
        start = time.perf_counter()
        following = (pipeline.components[VAE_ENCODER_NEXT] if pipeline.condition_channels
                     else None)
        image_encoder = ImageEncoder(pipeline.components[VAE_ENCODER], following, backend,
                                     geometry.temporal)
        seconds["load"] += time.perf_counter() - start
        start = time.perf_counter()
        condition = image_encoder(pixels, request.frames)
        del image_encoder
        seconds["vae_encode"] = time.perf_counter() - start
        report(f"encoded the image in {seconds['vae_encode']:.2f} s")

    start = time.perf_counter()
    layout = (timestep_layout(transformer, shape) if condition is None else
              timestep_layout(transformer, shape, condition.first_frame, condition.channels))
    sample = denoise(pipeline.experts, plan, split, backend, text, negative, shape, request,
                     layout,
                     progress)
    latents = sample.latents
    seconds["denoise"] = sum(sample.step_seconds)
    seconds["load"] += time.perf_counter() - start - seconds["denoise"]
    if kind == LATENTS_FORMAT:
        np.save(out, latents)
        return VideoResult(sample=sample, frames=None, seconds=seconds)

    start = time.perf_counter()
    first, following = pipeline.components[VAE_FIRST_FRAME], pipeline.components[VAE_NEXT_FRAME]
    tiled = vae_tiling is not None and vae_tiling.applies(*shape[3:], geometry)
    if tiled and plan is not None:  # each worker loads its own (counted as decoding here)
        video = decode_video(None, latents, vae_tiling,
                             decode_tiles_on_workers(plan, first, following, backend), geometry)
    else:
        before = resident_bytes()
        decoder = VaeDecoder(first, following, backend)
        seconds["load"] += time.perf_counter() - start
        start = time.perf_counter()
        video = decode_video(decoder, latents, vae_tiling, geometry=geometry)
        report(held_line("the VAE decoder (with the decoded video)", before,
                         [first, following]))
        del decoder
    frames = to_frames(video)
    del video  # not held while the frames are encoded
    seconds["vae_decode"] = time.perf_counter() - start
    where = f"in tiles on {workers} worker(s)" if tiled else "whole"
    report(f"decoded {frames.shape[0]} frames ({where}) in {seconds['vae_decode']:.2f} s")
    if out is not None:
        write_video(frames, out, fps)
    return VideoResult(sample=sample, frames=frames, seconds=seconds)


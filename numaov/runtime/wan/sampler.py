"""Sampling Wan video latents: the denoising loop with classifier-free guidance.

The loop is diffusers' ``WanPipeline`` with ``FlowMatchEulerDiscreteScheduler(shift=...)``
(the scheduler class WanPipeline is declared with), on latents only (no text encoder,
no VAE): text embeddings come from a ``.npy`` file, the final latents go to one. What a
request is lives in ``request``, the schedules in ``schedules``, the backends in
``denoisers``, the memory estimate in ``memory``.

- Step: ``v = v_uncond + g * (v_cond - v_uncond)`` in f32, then the schedule's update. At
  guidance 1 (``g == 1``, the guidance-free sampling of distilled LoRAs) a step runs the
  conditional branch alone and ``v = v_cond``, as diffusers' ``WanPipeline`` does when
  ``guidance_scale`` is 1 (its ``do_classifier_free_guidance`` is off); with two experts
  ``guidance_2`` 1 makes the second expert's steps single-branch, and ``guidance`` 1 turns
  guidance off for both whatever ``guidance_2`` is, as in diffusers.
- Guidance: the conditional and unconditional predictions come from one batch of two
  (``[cond, uncond]``) on one worker (or on each worker of a token split, ``parallel``), or
  from workers of one branch each whose predictions are joined every step by the
  shared-memory ``all_gather_into_tensor``. The loop does not know which: it asks a
  ``GuidedPredictor`` for both halves.
- Noise: ``torch.randn(shape, generator=torch.Generator().manual_seed(seed))`` as diffusers'
  ``prepare_latents`` does with a CPU generator, so every backend starts from the same noise.
- Timesteps: a graph exported with ``timestep="per-frame"`` (manifest field ``timestep``) is
  fed ``[B, F']``, one per latent frame after patching; otherwise ``[B]``.
- Image-to-video (Wan 2.2 TI2V, diffusers' ``WanImageToVideoPipeline`` with
  ``expand_timesteps=True``): given first-frame latents, the model input's first latent frame
  is those latents at every step and its timestep is 0 (``mask * t`` with the mask 0 on frame
  0, 1 elsewhere; our per-frame ``[B, F']`` is diffusers' per-token ``[B, L]`` with one value
  per frame), and the result's first frame is replaced by them too. diffusers keeps stepping
  frame 0 underneath and overwrites it in each model input; the Euler update is element-wise,
  so overwriting it in the latents themselves, as here, gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.models.wan import SEQUENCE_GROUP
from numaov.runtime.manifest_reader import ModelDirError, ModelManifest, read_manifest
from numaov.runtime.placement.binding import BindingPlan, check_bind_string, plan_for_ranks
from numaov.runtime.placement.topology import format_cpu_list
from numaov.runtime.wan.denoisers import BACKENDS, Denoiser, open_denoiser, unknown_backend
from numaov.runtime.wan.memory import check_memory, estimate_memory, held_line, resident_bytes
from numaov.runtime.wan.parallel import (
    WorkerSplit,
    check_split,
    choose_split,
    join_token_group,
    reclaim_token_groups,
    sequence_manifest,
)
from numaov.runtime.wan.request import (
    DEFAULT_SHIFT,
    PER_FRAME,
    SamplerInputError,
    WanSampleRequest,
    check_against_manifest,
    condition_channels,
    latent_shape,
    load_first_frame_latents,
    load_text_embeddings,
    video_tokens,
)
from numaov.runtime.wan.schedules import (
    check_sampler,
    check_shift,
    make_schedule,
    scheduler_config,
)
from numaov.runtime.wan.step_cache import save_measured_ratios

logger = logging.getLogger(__name__)


class GuidanceSplitError(NumaovError):
    """The workers of a split disagree: their predictions were not joined correctly."""


Progress = Callable[[str], None] | None


# -- guidance ---------------------------------------------------------------------------------


class GuidedPredictor:
    """Both guidance branches' predictions ``(cond, uncond)`` for the current latents, or
    the conditional one alone (a step at guidance 1).

    ``timestep`` is one sample's: ``[1]``, or ``[1, F']`` for a per-frame graph.
    """

    def __call__(
        self, latents: np.ndarray, timestep: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def conditional(self, latents: np.ndarray, timestep: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class BatchedGuidance(GuidedPredictor):
    """Conditional and unconditional in one batch of two on one denoiser (``negative``
    None: every step is conditional alone, a batch of one)."""

    def __init__(self, denoiser: Denoiser, text: np.ndarray,
                 negative: np.ndarray | None) -> None:
        self._denoiser = denoiser
        self._cond = np.ascontiguousarray(text[None])  # [1, S, D]
        self._text = (None if negative is None
                      else np.ascontiguousarray(np.stack([text, negative])))  # [2, S, D]

    def conditional(self, latents: np.ndarray, timestep: np.ndarray) -> np.ndarray:
        return self._denoiser.predict(np.ascontiguousarray(latents), timestep, self._cond)

    def __call__(
        self, latents: np.ndarray, timestep: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        batch = np.ascontiguousarray(np.concatenate([latents, latents]))  # [2, C, F, H, W]
        t = np.ascontiguousarray(np.concatenate([timestep, timestep]))  # [2] or [2, F']
        out = self._denoiser.predict(batch, t, self._text)
        return out[0:1], out[1:2]


class GatheredGuidance(GuidedPredictor):
    """This worker's branch on its own denoiser; every worker's prediction is joined through
    ``all_gather_into_tensor`` so each holds both branches: ``split``'s first ``shares``
    workers run the conditional branch, the others the unconditional one (with token
    shares, every worker of a branch holds the whole prediction)."""

    def __init__(self, denoiser: Denoiser, branch_text: np.ndarray, communicator: Any,
                 split: WorkerSplit) -> None:
        self._denoiser = denoiser
        self._text = np.ascontiguousarray(branch_text[None])  # [1, S, D]
        self._communicator = communicator
        self._split = split

    def __call__(
        self, latents: np.ndarray, timestep: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        mine = np.ascontiguousarray(self._denoiser.predict(latents, timestep, self._text))
        every = np.empty((self._split.workers, *mine.shape[1:]), dtype=np.float32)
        self._communicator.all_gather_into_tensor(every, mine)  # worker r's rows at [r]
        uncond = self._split.shares  # the first worker of the second branch
        return every[0:1], every[uncond:uncond + 1]

    def conditional(self, latents: np.ndarray, timestep: np.ndarray) -> np.ndarray:
        # Only with guidance 1 on some steps and not others (two experts): the workers still
        # step together, each running its branch; a split of the branches refuses a request
        # at guidance 1 throughout (``parallel.choose_split``).
        return self(latents, timestep)[0]


# -- the loop ---------------------------------------------------------------------------------


def initial_noise(shape: Sequence[int], seed: int) -> np.ndarray:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).numpy()


@dataclass
class SampleResult:
    latents: np.ndarray
    backend: str
    workers: int
    step_seconds: list[float] = field(default_factory=list)
    # Per transformer and guidance branch (cond, uncond), per evaluation: "C" every block
    # ran, "." the step cache skipped them (``cache_decisions``); none without a cache.
    cache_decisions: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        """Transformer evaluations the step cache skipped."""
        return sum(branch.count(".") for branch in self.cache_decisions)

    def summary(self, out: str | Path | None = None) -> str:
        """One line for the CLI."""
        total = sum(self.step_seconds)
        per_step = total / max(len(self.step_seconds), 1)
        where = f"wrote {out}: " if out is not None else ""
        return (
            f"{where}latents {list(self.latents.shape)} from {len(self.step_seconds)} steps on "
            f"{self.backend} with {self.workers} worker(s) in {total:.2f} s ({per_step:.3f} s/step"
            f"{self.cached()})"
        )

    def cached(self) -> str:
        return f", {self.skipped} evaluations skipped by the step cache" if self.skipped else ""


@dataclass(frozen=True)
class TimestepLayout:
    """How each step's timestep is fed: ``frames`` is F' for a per-frame graph (None: one
    timestep per sample); ``first_frame`` the ``[1, C, 1, H', W']`` conditioning latents;
    ``channels`` the ``[1, K, F', H', W']`` condition channels every model input ends with
    (Wan 2.2 I2V's mask and encoded condition video, ``runtime/wan/image_condition.py``)."""

    frames: int | None = None
    first_frame: np.ndarray | None = None
    channels: np.ndarray | None = None

    def timestep(self, t: float) -> np.ndarray:
        """One sample's timestep: ``[1]``, or ``[1, F']`` with 0 on a conditioned frame 0."""
        if self.frames is None:
            return np.full((1,), t, dtype=np.float32)
        per_frame = np.full((1, self.frames), t, dtype=np.float32)
        if self.first_frame is not None:
            per_frame[:, 0] = 0.0  # diffusers' first_frame_mask * t
        return per_frame

    def condition(self, latents: np.ndarray) -> np.ndarray:
        """``latents`` (changed in place) with frame 0 replaced by the conditioning, if any."""
        if self.first_frame is not None:
            latents[:, :, :1] = self.first_frame
        return latents

    def model_input(self, latents: np.ndarray) -> np.ndarray:
        """The transformer's input: the conditioned latents, then any condition channels
        (diffusers' ``torch.cat([latents, condition], dim=1)``)."""
        latents = self.condition(latents)
        if self.channels is None:
            return latents
        return np.concatenate([latents, self.channels], axis=1)


def timestep_layout(transformer: ModelManifest, shape: Sequence[int],
                    first_frame: np.ndarray | None = None,
                    channels: np.ndarray | None = None) -> TimestepLayout:
    """Per-frame timesteps (F' of ``shape``'s latents) for a transformer exported with them
    (Wan 2.2 TI2V: diffusers' ``expand_timesteps`` per-token timesteps are one value per
    latent frame), else one per sample; ``first_frame`` conditions frame 0, ``channels`` are
    appended to every model input."""
    if transformer.timestep != PER_FRAME:
        return TimestepLayout(first_frame=first_frame, channels=channels)
    patch_t = int(list(transformer.config.get("patch_size", (1, 2, 2)))[0])
    return TimestepLayout(frames=shape[2] // patch_t, first_frame=first_frame,
                          channels=channels)


def sample(
    predictors: Sequence[GuidedPredictor],
    shape: Sequence[int],
    request: WanSampleRequest,
    progress: Progress = None,
    layout: TimestepLayout = TimestepLayout(),
) -> tuple[np.ndarray, list[float]]:
    """Run the schedule's loop from seeded noise; returns the final latents and per-step
    seconds. ``predictors`` holds one predictor per expert (``request.expert`` picks it).
    Progress says each step's time, the time so far and an estimate of the rest."""
    report = progress or (lambda _msg: None)
    schedule = make_schedule(request)
    latents = initial_noise(shape, request.seed)
    seconds = []
    for i, timestep in enumerate(schedule.timesteps):
        start = time.perf_counter()
        expert = request.expert(timestep)
        guidance = np.float32(request.guidance_at(expert))
        if guidance == 1:  # one branch: diffusers' noise_pred without guidance
            velocity = predictors[expert].conditional(layout.model_input(latents),
                                                      layout.timestep(timestep))
        else:
            cond, uncond = predictors[expert](layout.model_input(latents),
                                              layout.timestep(timestep))
            velocity = uncond + guidance * (cond - uncond)
        latents = schedule.step(velocity, i, latents)
        seconds.append(time.perf_counter() - start)
        elapsed = sum(seconds)
        remaining = elapsed / len(seconds) * (request.steps - len(seconds))
        report(f"step {i + 1}/{request.steps} (t={timestep:.1f}) {seconds[-1]:.2f} s, "
               f"elapsed {elapsed:.1f} s, remaining ~{remaining:.1f} s")
    return layout.condition(latents), seconds


@dataclass(frozen=True)
class _RankJob:
    """What a worker needs; plain data, so it pickles into a spawned process."""

    model_dirs: tuple[str, ...]  # one per expert (with token shares: its split graph)
    backend: str
    text: np.ndarray
    negative: np.ndarray | None
    shape: tuple[int, ...]
    request: WanSampleRequest
    layout: TimestepLayout
    split: WorkerSplit


def _split_rank(context: Any, job: _RankJob) -> tuple[np.ndarray, list[float], list[str]]:
    """Worker body: this worker's branch(es) on its share of the tokens (``parallel``), every
    step joined with the other workers'."""
    from numaov.distributed.communicator import destroy_communicator, find_communicator
    from numaov.runtime.wan.denoisers import OpenVINODenoiser

    split = job.split
    branch, share = split.place(context.rank)
    token_group = join_token_group(split, context.rank)
    denoisers = []
    try:
        for expert, directory in enumerate(job.model_dirs):
            manifest = read_manifest(directory, expected_kind="wan")
            denoisers.append(
                open_transformer(manifest, job.backend, job.request, expert,
                                 context.openvino_config())
                if split.shares == 1 else
                OpenVINODenoiser(manifest, context.openvino_config(), sequence_rank=share))
        if split.branches == 1:
            predictors = [BatchedGuidance(d, job.text, job.negative) for d in denoisers]
        else:
            branch_text = job.text if branch == 0 else job.negative
            communicator = find_communicator(context.group)
            predictors = [GatheredGuidance(d, branch_text, communicator, split)
                          for d in denoisers]
        latents, seconds = sample(predictors, job.shape, job.request, layout=job.layout)
        if branch == 0:  # the conditional branch's magnitude ratios, when calibrating
            save_measured_ratios(denoisers, job.request)
        return latents, seconds, cache_decisions(denoisers)
    finally:
        for denoiser in denoisers:
            denoiser.close()
        if token_group is not None:
            destroy_communicator(SEQUENCE_GROUP)


def open_transformer(manifest: ModelManifest, backend: str, request: WanSampleRequest,
                     expert: int = 0, config: dict[str, Any] | None = None) -> Denoiser:
    """The request's transformer ``expert`` (0, or 1 for a two-expert pipeline's second):
    ``open_denoiser``'s, or with ``request.cache`` the step cache's (``step_cache``)."""
    if request.cache is None:
        return open_denoiser(manifest, backend, config)
    from numaov.runtime.wan.step_cache import open_cached_denoiser

    return open_cached_denoiser(manifest, backend, request.cache,
                                expert_steps(request)[expert], config)


def expert_steps(request: WanSampleRequest) -> list[int]:
    """The steps each transformer runs: ``[steps]``, or the two experts' shares (of the
    request's schedule: a pipeline's request once its scheduler is set)."""
    counts = [0, 0]
    for timestep in make_schedule(request).timesteps:
        counts[request.expert(timestep)] += 1
    return counts if request.boundary_timestep is not None else counts[:1]


def cache_decisions(denoisers: Sequence[Denoiser]) -> list[str]:
    """The step cache's decisions (``step_cache._GraphParts.decisions``), a string per
    transformer and guidance branch; none without a cache."""
    return [branch for d in denoisers for branch in getattr(d, "decisions", [])]


def validate_request(request: WanSampleRequest, backend: str, workers: int,
                     parallel: str | None = None) -> WorkerSplit:
    """Check ``request`` before any work; returns how its ``workers`` share it."""
    if backend not in BACKENDS:
        raise unknown_backend(backend)
    if not isinstance(request.steps, int) or request.steps < 1:
        raise SamplerInputError(f"steps={request.steps!r}; expected a positive integer")
    for name in ("guidance", "guidance_2"):
        value = getattr(request, name)
        if value is not None and not (math.isfinite(value) and value >= 1.0):
            raise SamplerInputError(
                f"{name}={value}; expected a finite number >= 1 (1 disables guidance; Wan uses "
                "5)", parameter=name
            )
    if not isinstance(request.seed, int) or not 0 <= request.seed < 2**63:
        raise SamplerInputError(f"seed={request.seed!r}; expected an integer in [0, 2**63)")
    if request.cache is not None:
        from numaov.runtime.wan.step_cache import check_cache

        check_cache(request.cache, backend)
    check_sampler(request.sampler)
    check_shift(request.shift)
    split = choose_split(workers, parallel, guided=not request.unguided)
    check_split(split, backend, request.cache)
    return split


def run_wan(
    model_dir: str | Path,
    request: WanSampleRequest,
    text_embeddings: str | Path,
    out: str | Path | None,
    *,
    negative_embeddings: str | Path | None = None,
    first_frame_latents: str | Path | None = None,
    backend: str = "openvino",
    workers: int = 1,
    parallel: str | None = None,
    progress: Progress = None,
) -> SampleResult:
    """Sample latents with an exported Wan model and (if ``out`` is given) save them as .npy.

    ``workers`` > 1 run on worker processes of the binding plan
    (:func:`numaov.runtime.placement.binding.plan_for_ranks`), each pinned with its own
    compiled model, split as ``parallel`` says (``runtime/wan/parallel.py``: guidance
    branches, token shares or both; None: guidance for 2 guided workers, else tokens);
    ``workers=1`` runs in this process, unpinned (a set ``NUMAOV_CPU_BIND`` is still checked).
    ``first_frame_latents`` (a ``.npy`` of ``[C, 1, H', W']`` or ``[1, C, 1, H', W']``)
    conditions the video on its first latent frame (Wan 2.2 TI2V image-to-video); it needs a
    model exported with ``timestep="per-frame"``.
    """
    report = progress or (lambda _msg: None)
    split = validate_request(request, backend, workers, parallel)
    if negative_embeddings is not None and request.unguided:
        raise SamplerInputError(
            f"negative embeddings {str(negative_embeddings)!r} with guidance 1, which runs no "
            "unconditional branch; expected no negative embeddings (or guidance > 1)",
            parameter="negative_embeddings")
    if request.guidance_2 is not None:
        raise SamplerInputError(
            f"guidance_2={request.guidance_2} is the second expert's guidance; expected it only "
            "with a prompt on a Wan 2.2 two-expert pipeline export", parameter="guidance_2"
        )
    plan = worker_plan(split)  # the placement is checked before any file is read
    manifest = read_manifest(model_dir, expected_kind="wan")
    check_split_graphs([manifest], split)
    if request.cache is not None:
        from numaov.runtime.wan.step_cache import check_cache_export

        check_cache_export(manifest, request.cache, request.steps)
    config = manifest.config
    missing = [key for key in ("in_channels", "text_dim", "patch_size") if key not in config]
    if missing:
        raise ModelDirError(
            f"manifest config in {str(manifest.directory)!r} lacks {missing}; expected a Wan "
            "transformer config (re-export the model)"
        )
    condition = condition_channels(config)
    if condition:
        raise SamplerInputError(
            f"the transformer in {str(manifest.directory)!r} takes {condition} image-to-video "
            f"condition channels beside its latents (in_channels {config['in_channels']}); "
            "expected a text-to-video transformer here, or its pipeline export with an image"
        )
    shape = latent_shape(config, request.frames, request.height, request.width)
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        if out_path.suffix != ".npy":
            raise SamplerInputError(f"output file {str(out_path)!r} does not end in .npy; "
                                    "expected a .npy path", parameter="out")
        if not out_path.parent.is_dir():
            raise SamplerInputError(f"the directory of output file {str(out_path)!r} does not "
                                    "exist; expected a path in an existing directory",
                                    parameter="out")
    text_dim = int(config["text_dim"])
    text = load_text_embeddings(text_embeddings, text_dim, "text embeddings")
    if request.unguided:
        negative = None
    elif negative_embeddings is None:
        # Zeros are what Wan's pipeline puts past a prompt's last token, so an all-zero
        # embedding is the "no prompt" stand-in; a real negative prompt needs the file.
        negative = np.zeros_like(text)
    else:
        negative = load_text_embeddings(negative_embeddings, text_dim, "negative embeddings")
        if negative.shape != text.shape:
            raise SamplerInputError(
                f"negative embeddings have shape {list(negative.shape)} but text embeddings "
                f"{list(text.shape)}; expected the same (pad both to the text encoder's length, "
                "512 for Wan's UMT5)"
            )
    layout = timestep_layout(
        manifest, shape,
        None if first_frame_latents is None
        else load_first_frame_latents(first_frame_latents, shape, manifest),
    )
    batch = 2 if split.branches == 1 and not request.unguided else 1
    check_against_manifest(
        manifest,
        {
            "hidden_states": (batch, *shape[1:]),
            "timestep": (batch,) if layout.frames is None else (batch, layout.frames),
            "encoder_hidden_states": (batch, *text.shape),
        },
    )
    check_memory(estimate_memory([manifest], shape, text.shape[0], workers,
                                 branches=request.branches))
    request = dataclasses.replace(request, scheduler=scheduler_config(request.sampler,
                                                                      request.shift, None))
    result = denoise([manifest], plan, split, backend, text, negative, shape, request, layout,
                     progress)
    if out_path is not None:
        np.save(out_path, result.latents)
        report(f"wrote {out_path}")
    return result


def check_split_graphs(experts: Sequence[ModelManifest], split: WorkerSplit) -> None:
    """A token split needs every transformer's graph for its share count: refused before
    any work (``parallel.sequence_manifest``)."""
    if split.shares > 1:
        for manifest in experts:
            sequence_manifest(manifest, split.shares)


def worker_plan(split: WorkerSplit) -> BindingPlan | None:
    """The binding plan of ``split``'s workers (None: one, in this process)."""
    if split.workers > 1:
        return plan_for_ranks(split.workers)
    check_bind_string("sampling with workers=1")
    return None


def denoise(
    experts: Sequence[ModelManifest],
    plan: BindingPlan | None,
    split: WorkerSplit,
    backend: str,
    text: np.ndarray,
    negative: np.ndarray | None,
    shape: tuple[int, ...],
    request: WanSampleRequest,
    layout: TimestepLayout,
    progress: Progress = None,
) -> SampleResult:
    """The sampling loop on one worker (``plan`` None: in this process, both guidance
    branches in one batch) or on the plan's workers, as ``split`` shares the work; ``experts``
    are the transformers (one, or Wan 2.2's two). ``negative`` is None for an unguided
    request (every step at guidance 1)."""
    report = progress or (lambda _msg: None)
    if request.unused_guidance_2 is not None:
        report(request.unused_guidance_2)
    workers = split.workers
    schedule = (f", {request.scheduler.get('_class_name')}" if request.scheduler else
                f", Euler with shift {request.shift or DEFAULT_SHIFT:g}")
    report(
        f"sampling latents {list(shape)} ({request.steps} steps, guidance {request.guidance}"
        f"{', one branch per step' if request.unguided else ''}{schedule}) on "
        f"{backend} with {workers} worker(s)"
        + ("" if plan is None else "; " + split.describe(
            video_tokens(experts[0].config, shape), [format_cpu_list(r.cpus) for r in plan.ranks]))
    )
    if workers == 1:
        start = time.perf_counter()
        before = resident_bytes()
        denoisers = [open_transformer(manifest, backend, request, expert)
                     for expert, manifest in enumerate(experts)]
        attention = getattr(denoisers[0], "attention", None)
        report(
            f"loaded {len(denoisers)} transformer(s) on {backend}"
            + (f" (attention: {attention}'s)" if attention else "")
            + f" in {time.perf_counter() - start:.1f} s"
        )
        try:
            latents, seconds = sample(
                [BatchedGuidance(d, text, negative) for d in denoisers], shape, request,
                progress, layout
            )
            decisions = cache_decisions(denoisers)
            save_measured_ratios(denoisers, request)
            report(held_line(f"the transformer(s) on {backend}", before, experts))
        finally:
            for denoiser in denoisers:
                denoiser.close()
    else:
        from numaov.runtime.placement.workers import run_on_ranks

        graphs = (experts if split.shares == 1 else
                  [sequence_manifest(m, split.shares) for m in experts])
        job = _RankJob(tuple(str(m.directory) for m in graphs), backend, text, negative,
                       tuple(shape), request, layout, split)
        # With one branch the workers' own group is the one the split graphs' nodes name.
        try:
            results = run_on_ranks(plan, _split_rank, [job] * workers,
                                   group=SEQUENCE_GROUP if split.branches == 1 else None)
        finally:
            reclaim_token_groups(split)
        latents, seconds, _ = results[0]
        # The step cache runs with the guidance split only: one rank per branch, and per
        # transformer cond then uncond, as one worker's batch rows give them.
        uncond = results[split.shares][2] if split.branches == 2 else []  # its first worker
        decisions = [b for pair in zip(results[0][2], uncond, strict=True) for b in pair]
        # Every worker applies the same update to the same gathered predictions, so they
        # must agree exactly; a difference would mean a gather mixed up rows or steps.
        if not all(np.array_equal(latents, other) for other, _, _ in results[1:]):
            raise GuidanceSplitError(
                f"the {workers} workers ({split.name} split) ended with different latents; "
                "expected identical latents from the same gathered predictions"
            )
    report(f"sampled in {sum(seconds):.2f} s ({sum(seconds) / len(seconds):.2f} s per step)")
    result = SampleResult(latents=latents, backend=backend, workers=workers,
                          step_seconds=seconds, cache_decisions=decisions)
    if request.cache is not None:
        report_cache(request, result, experts, report)
    return result


def report_cache(request: WanSampleRequest, result: SampleResult,
                 experts: Sequence[ModelManifest], report: Callable[[str], None]) -> None:
    """The step cache's line: the evaluations it skipped, or where calibration wrote."""
    from numaov.runtime.wan.step_cache import RATIOS_FILE, StepCacheSetting

    setting = StepCacheSetting.parse(str(request.cache))
    decisions = result.cache_decisions
    if setting.calibrate:  # (a transformer that ran no step has none to write)
        steps = expert_steps(request)
        written = [str(m.directory / RATIOS_FILE)
                   for m, n in zip(experts, steps, strict=True) if n]
        report(f"step cache {setting}: measured the magnitude ratios of "
               f"{' and '.join(map(str, steps))} step(s), written to {', '.join(written)}")
        return
    report(f"step cache {setting}: skipped {result.skipped} of {sum(map(len, decisions))} "
           f"transformer evaluations ({setting.skipped_work} only; {' '.join(decisions)})")

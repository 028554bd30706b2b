"""Sampling Wan video latents: flow-matching Euler with classifier-free guidance.

The loop is diffusers' ``WanPipeline`` with ``FlowMatchEulerDiscreteScheduler(shift=...)``
(the scheduler class WanPipeline is declared with), on latents only (no text encoder,
no VAE): text embeddings come from a ``.npy`` file, the final latents go to one.

- Schedule: ``FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=s)``
  followed by ``set_timesteps(N)``, reproduced exactly (``flow_match_sigmas``): N sigmas
  evenly spaced from 1 down to the shifted training minimum ``s*0.001 / (1 + (s-1)*0.001)``,
  each passed through Wan's shift ``sigma' = s*sigma / (1 + (s-1)*sigma)``, then a
  terminal 0. The model is given ``timestep = 1000 * sigma``. Wan 2.1 T2V uses ``s = 5``.
- Step: ``x <- x + (sigma_next - sigma) * v`` with ``v = v_uncond + g * (v_cond - v_uncond)``,
  all in f32.
- Guidance: the conditional and unconditional predictions come from one batch of two
  (``[cond, uncond]``) on one worker, or from two workers (one branch each) whose halves
  are joined every step by the shared-memory ``all_gather_into_tensor``. The loop does not
  know which: it asks a ``GuidedPredictor`` for both halves.
- Backends: OpenVINO (the compiled IR, one infer request), ONNX Runtime (the ONNX file),
  PyTorch (``numaov.models.wan`` on the exported checkpoint). All take and return f32
  numpy arrays behind ``Denoiser``, so no call site branches on the backend.
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

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.runtime.binding import BindingPlan, check_bind_string, plan_for_ranks
from numaov.runtime.comparison import max_rel_error
from numaov.runtime.manifest_reader import ModelDirError, ModelManifest, read_manifest

logger = logging.getLogger(__name__)

BACKENDS = ("openvino", "onnxruntime", "torch")
DEFAULT_SHIFT = 5.0
NUM_TRAIN_TIMESTEPS = 1000
# Wan's VAE: 4x temporal compression with the first frame kept (frames = 4k + 1), 8x spatial.
VAE_TEMPORAL_FACTOR = 4
VAE_SPATIAL_FACTOR = 8
INPUT_NAMES = ("hidden_states", "timestep", "encoder_hidden_states")
MAX_WORKERS = 2  # one per guidance branch
PER_FRAME = "per-frame"  # the manifest's ``timestep`` for [B, F'] graphs


class SamplerInputError(NumaovError):
    """A sampling request whose arguments or input files do not fit the model."""


class GuidanceSplitError(NumaovError):
    """The two guidance workers disagree: their predictions were not joined correctly."""


Progress = Callable[[str], None] | None


# -- schedule ---------------------------------------------------------------------------------


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """Wan's timestep shift ``s*sigma / (1 + (s-1)*sigma)``: more steps at high noise for s > 1."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_match_sigmas(steps: int, shift: float = DEFAULT_SHIFT) -> np.ndarray:
    """``steps + 1`` f32 sigmas (the last is 0), as diffusers' FlowMatchEulerDiscreteScheduler.

    The arithmetic follows diffusers step by step, including its precisions (the training
    table in f32, the inference spacing in f64), so the schedule matches it bit for bit.
    """
    if steps < 1:
        raise SamplerInputError(f"steps={steps}; expected at least 1")
    if not (math.isfinite(shift) and shift > 0):
        raise SamplerInputError(f"shift={shift}; expected a positive number (Wan uses 3.0 to 5.0)")
    train = np.arange(NUM_TRAIN_TIMESTEPS, 0, -1, dtype=np.float32) / np.float32(
        NUM_TRAIN_TIMESTEPS
    )
    train = shift_sigmas(train, np.float32(shift)).astype(np.float32)
    sigma_max, sigma_min = float(train[0]), float(train[-1])
    spaced = np.linspace(sigma_max * NUM_TRAIN_TIMESTEPS, sigma_min * NUM_TRAIN_TIMESTEPS, steps)
    sigmas = shift_sigmas(spaced / NUM_TRAIN_TIMESTEPS, shift).astype(np.float32)
    return np.concatenate([sigmas, np.zeros(1, dtype=np.float32)])


# -- request validation -----------------------------------------------------------------------


@dataclass(frozen=True)
class WanSampleRequest:
    """What to sample: the video size (in pixels / frames), the schedule and the seed."""

    frames: int
    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    shift: float = DEFAULT_SHIFT


def latent_shape(config: dict[str, Any], frames: int, height: int, width: int) -> tuple[int, ...]:
    """``(1, C, F, H, W)`` latents for a video of ``frames`` x ``height`` x ``width`` pixels.

    Wan's VAE maps ``frames = 4k + 1`` to ``k + 1`` latent frames and divides height and
    width by 8; the transformer then needs latent sizes divisible by its patch size. Sizes
    that do not fit are errors (diffusers rounds them; here nothing is silently changed).
    """
    patch = list(config.get("patch_size", (1, 2, 2)))
    channels = int(config["in_channels"])
    for name, value in (("frames", frames), ("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SamplerInputError(f"{name}={value!r}; expected a positive integer")
    if (frames - 1) % VAE_TEMPORAL_FACTOR != 0:
        lower = (frames - 1) // VAE_TEMPORAL_FACTOR * VAE_TEMPORAL_FACTOR + 1
        raise SamplerInputError(
            f"frames={frames}; expected {VAE_TEMPORAL_FACTOR}k+1 video frames (Wan's VAE keeps "
            f"the first frame and compresses the rest {VAE_TEMPORAL_FACTOR}x), e.g. {lower} or "
            f"{lower + VAE_TEMPORAL_FACTOR}"
        )
    latent_frames = (frames - 1) // VAE_TEMPORAL_FACTOR + 1
    if latent_frames % patch[0] != 0:
        raise SamplerInputError(
            f"frames={frames} gives {latent_frames} latent frames, not a multiple of the temporal "
            f"patch size {patch[0]}"
        )
    dims = [latent_frames]
    for name, value, p in (("height", height, patch[1]), ("width", width, patch[2])):
        multiple = VAE_SPATIAL_FACTOR * p
        if value % multiple != 0:
            lower = max(multiple, value // multiple * multiple)
            raise SamplerInputError(
                f"{name}={value}; expected a multiple of {multiple} (VAE factor "
                f"{VAE_SPATIAL_FACTOR} x patch size {p}), e.g. {lower} or {lower + multiple}"
            )
        dims.append(value // VAE_SPATIAL_FACTOR)
    return (1, channels, *dims)


def _load_npy(path: str | Path, what: str) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise SamplerInputError(f"{what} file {str(path)!r} not found")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise SamplerInputError(f"{what} file {str(path)!r} is not a .npy array ({exc})") from exc


def _finite_f32(array: np.ndarray, path: str | Path, what: str) -> np.ndarray:
    if not np.issubdtype(array.dtype, np.floating):
        raise SamplerInputError(
            f"{what} in {str(path)!r} have dtype {array.dtype}; expected floats"
        )
    array = array.astype(np.float32)
    if not np.all(np.isfinite(array)):
        raise SamplerInputError(f"{what} in {str(path)!r} contain NaN or infinity")
    return array


def load_text_embeddings(path: str | Path, text_dim: int, what: str) -> np.ndarray:
    """Read ``[S, D]`` (or ``[1, S, D]``) f32 text embeddings from a ``.npy`` file."""
    array = _load_npy(path, what)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] != text_dim:
        raise SamplerInputError(
            f"{what} in {str(path)!r} have shape {list(array.shape)}; expected [text_length, "
            f"{text_dim}] or [1, text_length, {text_dim}] (text_dim of the model)"
        )
    return _finite_f32(array, path, what)


def load_first_frame_latents(
    path: str | Path, shape: Sequence[int], manifest: ModelManifest
) -> np.ndarray:
    """Read first-frame latents for ``shape`` = (1, C, F, H', W') as ``[1, C, 1, H', W']`` f32.

    They are the VAE-encoded first frame, normalised as the transformer sees latents
    (diffusers' ``(z - latents_mean) * (1 / latents_std)``); the file may omit the batch axis.
    """
    what = "first-frame latents"
    if manifest.timestep != PER_FRAME:
        raise SamplerInputError(
            f"first-frame latents need a model exported with per-frame timesteps (Wan 2.2 TI2V "
            f"gives the conditioned frame timestep 0), but the model in "
            f"{str(manifest.directory)!r} takes one timestep per sample: re-export it with "
            f"timestep {PER_FRAME!r}", parameter="first_frame_latents"
        )
    patch_t = int(list(manifest.config.get("patch_size", (1, 2, 2)))[0])
    if patch_t != 1:
        raise SamplerInputError(
            f"first-frame latents need temporal patch size 1 (one latent frame per timestep, "
            f"as Wan 2.2 TI2V); this model's is {patch_t}", parameter="first_frame_latents"
        )
    array = _load_npy(path, what)
    expected = (1, shape[1], 1, *shape[3:])
    if tuple(array.shape) not in (expected, expected[1:]):
        raise SamplerInputError(
            f"{what} in {str(path)!r} have shape {list(array.shape)}; expected "
            f"{list(expected[1:])} or {list(expected)} (latent channels, one frame, height/"
            f"{VAE_SPATIAL_FACTOR}, width/{VAE_SPATIAL_FACTOR} of the requested video)"
        )
    return _finite_f32(array.reshape(expected), path, what)


def _check_against_manifest(manifest: ModelManifest, feeds: dict[str, tuple[int, ...]]) -> None:
    """Static axes recorded in the manifest must match; dynamic (named) axes take any size."""
    for name, shape in feeds.items():
        expected = manifest.inputs.get(name)
        if expected is None:
            raise SamplerInputError(
                f"model in {str(manifest.directory)!r} has no input {name!r}; expected a Wan "
                f"export with inputs {', '.join(INPUT_NAMES)}"
            )
        if len(expected) != len(shape) or any(
            isinstance(e, int) and e != s for e, s in zip(expected, shape, strict=False)
        ):
            raise SamplerInputError(
                f"input {name!r} would have shape {list(shape)} but the model was exported for "
                f"{expected} (names are dynamic axes)"
            )


# -- backends ---------------------------------------------------------------------------------


class Denoiser:
    """One Wan transformer behind one call: f32 numpy in, f32 numpy out, whatever runs it."""

    name = "base"

    def predict(
        self, hidden_states: np.ndarray, timestep: np.ndarray, text: np.ndarray
    ) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        """Release the compiled model / session."""


# OpenVINO 2026.4's fused attention (an MHA snippet) returns wrong values when the video has a
# single token (one query row) and the text 16 or more (cross-attention keys): off by the
# output's own magnitude, while the same graph compiled without snippets matches ONNX Runtime
# and PyTorch. Such inputs (a 16x16-pixel frame) run on a second compilation made on first use.
SINGLE_TOKEN_CONFIG = {"SNIPPETS_MODE": "DISABLE"}


def video_tokens(config: dict[str, Any], hidden_states_shape: Sequence[int]) -> int:
    """Video tokens per sample of ``[B, C, F, H, W]`` latents (after patching)."""
    patch = list(config.get("patch_size", (1, 2, 2)))
    frames, height, width = hidden_states_shape[2:5]
    return frames // patch[0] * (height // patch[1]) * (width // patch[2])


class OpenVINODenoiser(Denoiser):
    name = "openvino"

    def __init__(self, manifest: ModelManifest, config: dict[str, Any] | None = None) -> None:
        self._manifest, self._config = manifest, dict(config or {})
        # numaov's attention leaves no MHA snippet behind, so it needs no second compilation.
        self.attention = manifest.attention_kernel(config)
        self._compiled = manifest.compile_rank(0, config)
        self._request = self._compiled.create_infer_request()
        self._single_token_request = None

    def _request_for(self, hidden_states: np.ndarray) -> Any:
        if self.attention == "numaov":
            return self._request
        if video_tokens(self._manifest.config, hidden_states.shape) != 1:
            return self._request
        if self._single_token_request is None:
            compiled = self._manifest.compile_rank(0, {**self._config, **SINGLE_TOKEN_CONFIG})
            self._single_token_request = compiled.create_infer_request()
        return self._single_token_request

    def predict(
        self, hidden_states: np.ndarray, timestep: np.ndarray, text: np.ndarray
    ) -> np.ndarray:
        request = self._request_for(hidden_states)
        request.infer(
            {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": text}
        )
        return np.array(request.get_output_tensor(0).data, dtype=np.float32)

    def close(self) -> None:
        self._request = self._single_token_request = None
        self._compiled = None


class OnnxRuntimeDenoiser(Denoiser):
    name = "onnxruntime"

    def __init__(self, manifest: ModelManifest, threads: int | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self._session = ort.InferenceSession(
            str(manifest.rank(0).onnx), options, providers=["CPUExecutionProvider"]
        )

    def predict(
        self, hidden_states: np.ndarray, timestep: np.ndarray, text: np.ndarray
    ) -> np.ndarray:
        (out,) = self._session.run(
            None,
            {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": text},
        )
        return np.asarray(out, dtype=np.float32)

    def close(self) -> None:
        self._session = None


class TorchDenoiser(Denoiser):
    name = "torch"

    def __init__(self, manifest: ModelManifest) -> None:
        import torch

        from numaov.models.wan import WanTransformer

        source = manifest.source_checkpoint_dir("openvino or onnxruntime")
        dtype = torch.bfloat16 if manifest.precision == "bf16" else torch.float32
        self._torch = torch
        self._model = WanTransformer.from_pretrained(source, dtype=dtype)
        # The checkpoint is read from where it was at export time and may have changed since;
        # the graphs have not, so the backends would silently disagree.
        error = reference_error(self, manifest)
        if error is not None and error > (manifest.reference_tolerance or 0.0):
            raise SamplerInputError(
                f"checkpoint {str(source)!r} does not reproduce the output recorded at export "
                f"(max rel error {error:.3g}, tolerance {manifest.reference_tolerance}): it "
                "changed since the export; re-export it, or use the openvino or onnxruntime "
                "backend"
            )

    def predict(
        self, hidden_states: np.ndarray, timestep: np.ndarray, text: np.ndarray
    ) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            out = self._model(
                torch.from_numpy(hidden_states), torch.from_numpy(timestep), torch.from_numpy(text)
            )
        return out.float().numpy()

    def close(self) -> None:
        self._model = None


def reference_error(denoiser: Denoiser, manifest: ModelManifest) -> float | None:
    """Max error of ``denoiser`` on the export's reference sample, relative to the output's
    largest magnitude (the export's parity measure); None when the export recorded none."""
    if manifest.reference_sample is None:
        return None
    with np.load(manifest.reference_sample) as sample:
        inputs = [sample[f"input.{name}"] for name in INPUT_NAMES]
        expected = sample["output.sample"]
    got = denoiser.predict(*inputs)
    return max_rel_error(got, expected)


def open_denoiser(
    manifest: ModelManifest, backend: str, openvino_config: dict[str, Any] | None = None
) -> Denoiser:
    """The backend named ``backend`` on ``manifest``'s model; ``openvino_config`` adds
    compile properties (a worker's threads and pinning), and sets ONNX Runtime's threads."""
    if backend == "openvino":
        return OpenVINODenoiser(manifest, openvino_config)
    if backend == "onnxruntime":
        threads = (openvino_config or {}).get("INFERENCE_NUM_THREADS")
        return OnnxRuntimeDenoiser(manifest, int(threads) if threads else None)
    if backend == "torch":
        return TorchDenoiser(manifest)
    raise _unknown_backend(backend)


def _unknown_backend(backend: str) -> SamplerInputError:
    return SamplerInputError(
        f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}", parameter="backend"
    )


# -- guidance ---------------------------------------------------------------------------------


class GuidedPredictor:
    """Both guidance branches' predictions ``(cond, uncond)`` for the current latents.

    ``timestep`` is one sample's: ``[1]``, or ``[1, F']`` for a per-frame graph.
    """

    def __call__(
        self, latents: np.ndarray, timestep: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


class BatchedGuidance(GuidedPredictor):
    """Conditional and unconditional in one batch of two on one denoiser."""

    def __init__(self, denoiser: Denoiser, text: np.ndarray, negative: np.ndarray) -> None:
        self._denoiser = denoiser
        self._text = np.ascontiguousarray(np.stack([text, negative]))  # [2, S, D]

    def __call__(
        self, latents: np.ndarray, timestep: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        batch = np.ascontiguousarray(np.concatenate([latents, latents]))  # [2, C, F, H, W]
        t = np.ascontiguousarray(np.concatenate([timestep, timestep]))  # [2] or [2, F']
        out = self._denoiser.predict(batch, t, self._text)
        return out[0:1], out[1:2]


class GatheredGuidance(GuidedPredictor):
    """This rank's branch (rank 0 conditional, rank 1 unconditional) on its own denoiser; the
    two halves are joined through ``all_gather_into_tensor`` so every rank holds both."""

    def __init__(self, denoiser: Denoiser, branch_text: np.ndarray, communicator: Any) -> None:
        self._denoiser = denoiser
        self._text = np.ascontiguousarray(branch_text[None])  # [1, S, D]
        self._communicator = communicator

    def __call__(
        self, latents: np.ndarray, timestep: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        mine = np.ascontiguousarray(self._denoiser.predict(latents, timestep, self._text))
        both = np.empty((2, *mine.shape[1:]), dtype=np.float32)
        self._communicator.all_gather_into_tensor(both, mine)  # rank r's rows at [r]
        return both[0:1], both[1:2]


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

    def summary(self, out: str | Path | None = None) -> str:
        """One line for the CLI."""
        total = sum(self.step_seconds)
        per_step = total / max(len(self.step_seconds), 1)
        where = f"wrote {out}: " if out is not None else ""
        return (
            f"{where}latents {list(self.latents.shape)} from {len(self.step_seconds)} steps on "
            f"{self.backend} with {self.workers} worker(s) in {total:.2f} s ({per_step:.3f} s/step)"
        )


@dataclass(frozen=True)
class TimestepLayout:
    """How each step's timestep is fed: ``frames`` is F' for a per-frame graph (None: one
    timestep per sample); ``first_frame`` the ``[1, C, 1, H', W']`` conditioning latents."""

    frames: int | None = None
    first_frame: np.ndarray | None = None

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


def sample(
    predictor: GuidedPredictor,
    shape: Sequence[int],
    request: WanSampleRequest,
    progress: Progress = None,
    layout: TimestepLayout = TimestepLayout(),
) -> tuple[np.ndarray, list[float]]:
    """Run the Euler loop from seeded noise; returns the final latents and per-step seconds."""
    report = progress or (lambda _msg: None)
    sigmas = flow_match_sigmas(request.steps, request.shift)
    latents = initial_noise(shape, request.seed)
    guidance = np.float32(request.guidance)
    seconds = []
    for i in range(request.steps):
        start = time.perf_counter()
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        timestep = float(sigma * np.float32(NUM_TRAIN_TIMESTEPS))
        cond, uncond = predictor(layout.condition(latents), layout.timestep(timestep))
        velocity = uncond + guidance * (cond - uncond)
        latents = (latents + (sigma_next - sigma) * velocity).astype(np.float32)
        seconds.append(time.perf_counter() - start)
        report(f"step {i + 1}/{request.steps} (t={timestep:.1f}) {seconds[-1]:.2f} s")
    return layout.condition(latents), seconds


@dataclass(frozen=True)
class _RankJob:
    """What a guidance worker needs; plain data, so it pickles into a spawned process."""

    model_dir: str
    backend: str
    branch_text: np.ndarray
    shape: tuple[int, ...]
    request: WanSampleRequest
    layout: TimestepLayout


def _guidance_rank(context: Any, job: _RankJob) -> tuple[np.ndarray, list[float]]:
    """Worker body: this rank's branch, every step joined with the other rank's."""
    from numaov.custom_ops.collectives import find_communicator

    manifest = read_manifest(job.model_dir, expected_kind="wan")
    denoiser = open_denoiser(manifest, job.backend, context.openvino_config())
    try:
        predictor = GatheredGuidance(denoiser, job.branch_text, find_communicator(context.group))
        return sample(predictor, job.shape, job.request, layout=job.layout)
    finally:
        denoiser.close()


def _validate_request(request: WanSampleRequest, backend: str, workers: int) -> None:
    if backend not in BACKENDS:
        raise _unknown_backend(backend)
    if workers not in (1, MAX_WORKERS):
        raise SamplerInputError(
            f"workers={workers}; expected 1 (both guidance branches in one batch) or "
            f"{MAX_WORKERS} (one branch per worker)", parameter="workers"
        )
    if not isinstance(request.steps, int) or request.steps < 1:
        raise SamplerInputError(f"steps={request.steps!r}; expected a positive integer")
    if not (math.isfinite(request.guidance) and request.guidance >= 1.0):
        raise SamplerInputError(
            f"guidance={request.guidance}; expected a finite number >= 1 (1 disables guidance; "
            "Wan uses 5)"
        )
    if not isinstance(request.seed, int) or not 0 <= request.seed < 2**63:
        raise SamplerInputError(f"seed={request.seed!r}; expected an integer in [0, 2**63)")


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
    progress: Progress = None,
) -> SampleResult:
    """Sample latents with an exported Wan model and (if ``out`` is given) save them as .npy.

    ``workers=2`` runs the two guidance branches on two worker processes of the binding plan
    (:func:`numaov.runtime.binding.plan_for_ranks`), each pinned with its own compiled model;
    ``workers=1`` runs in this process, unpinned (a set ``NUMAOV_CPU_BIND`` is still checked).
    ``first_frame_latents`` (a ``.npy`` of ``[C, 1, H', W']`` or ``[1, C, 1, H', W']``)
    conditions the video on its first latent frame (Wan 2.2 TI2V image-to-video); it needs a
    model exported with ``timestep="per-frame"``.
    """
    report = progress or (lambda _msg: None)
    _validate_request(request, backend, workers)
    # The placement is checked before any file is read.
    plan = plan_for_ranks(MAX_WORKERS) if workers == MAX_WORKERS else None
    if plan is None:
        check_bind_string("sampling with workers=1")
    manifest = read_manifest(model_dir, expected_kind="wan")
    config = manifest.config
    missing = [key for key in ("in_channels", "text_dim", "patch_size") if key not in config]
    if missing:
        raise ModelDirError(
            f"manifest config in {str(manifest.directory)!r} lacks {missing}; expected a Wan "
            "transformer config (re-export the model)"
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
    if negative_embeddings is None:
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
    frames = shape[2] // int(list(config["patch_size"])[0])
    layout = TimestepLayout(
        frames=frames if manifest.timestep == PER_FRAME else None,
        first_frame=None
        if first_frame_latents is None
        else load_first_frame_latents(first_frame_latents, shape, manifest),
    )
    batch = 2 if workers == 1 else 1
    _check_against_manifest(
        manifest,
        {
            "hidden_states": (batch, *shape[1:]),
            "timestep": (batch,) if layout.frames is None else (batch, layout.frames),
            "encoder_hidden_states": (batch, *text.shape),
        },
    )
    report(
        f"sampling latents {list(shape)} ({request.steps} steps, guidance {request.guidance}) on "
        f"{backend} with {workers} worker(s)"
    )
    if workers == 1:
        start = time.perf_counter()
        denoiser = open_denoiser(manifest, backend)
        attention = getattr(denoiser, "attention", None)
        report(
            f"loaded the model on {backend}"
            + (f" (attention: {attention}'s)" if attention else "")
            + f" in {time.perf_counter() - start:.1f} s"
        )
        try:
            latents, seconds = sample(
                BatchedGuidance(denoiser, text, negative), shape, request, progress, layout
            )
        finally:
            denoiser.close()
    else:
        latents, seconds = _sample_on_workers(
            plan, manifest, backend, text, negative, shape, request, layout
        )
    report(f"sampled in {sum(seconds):.2f} s ({sum(seconds) / len(seconds):.2f} s per step)")
    if out_path is not None:
        np.save(out_path, latents)
        report(f"wrote {out_path}")
    return SampleResult(latents=latents, backend=backend, workers=workers, step_seconds=seconds)


def _sample_on_workers(
    plan: BindingPlan,
    manifest: ModelManifest,
    backend: str,
    text: np.ndarray,
    negative: np.ndarray,
    shape: tuple[int, ...],
    request: WanSampleRequest,
    layout: TimestepLayout,
) -> tuple[np.ndarray, list[float]]:
    from numaov.runtime.workers import run_on_ranks

    jobs = [
        _RankJob(str(manifest.directory), backend, branch, tuple(shape), request, layout)
        for branch in (text, negative)
    ]
    results = run_on_ranks(plan, _guidance_rank, jobs)
    (latents, seconds), (other, _) = results
    # Both ranks apply the same update to the same gathered predictions, so they must agree
    # exactly; a difference would mean the gather mixed up rows or steps.
    if not np.array_equal(latents, other):
        raise GuidanceSplitError(
            "the two guidance workers ended with different latents; expected identical latents "
            "from the same gathered predictions"
        )
    return latents, seconds

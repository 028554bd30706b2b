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
  all in f32. A request carrying a diffusers scheduler config (a pipeline export's, see
  ``wan_video``) is stepped by that diffusers scheduler instead (``DiffusersSchedule``).
- Guidance: the conditional and unconditional predictions come from one batch of two
  (``[cond, uncond]``) on one worker, or from two workers (one branch each) whose halves
  are joined every step by the shared-memory ``all_gather_into_tensor``. The loop does not
  know which: it asks a ``GuidedPredictor`` for both halves.
- Backends: OpenVINO (the compiled IR, one infer request), ONNX Runtime (the ONNX file),
  PyTorch (``numaov.models.wan.transformer`` on the exported checkpoint). All take and return f32
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
from numaov.runtime.comparison import max_rel_error
from numaov.runtime.manifest_reader import ModelDirError, ModelManifest, read_manifest
from numaov.runtime.placement.binding import BindingPlan, check_bind_string, plan_for_ranks

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
    # A diffusers scheduler config (a pipeline's scheduler/scheduler_config.json): when set,
    # that scheduler steps the latents instead of flow-matching Euler with ``shift``.
    scheduler: dict[str, Any] | None = None
    # Two experts (Wan 2.2 A14B): steps at timesteps below ``boundary_timestep`` run the
    # second transformer with guidance ``guidance_2`` (default: ``guidance``).
    boundary_timestep: float | None = None
    guidance_2: float | None = None

    def expert(self, timestep: float) -> int:
        """0 (the first transformer, high noise) or 1 (the second, low noise)."""
        return int(self.boundary_timestep is not None and timestep < self.boundary_timestep)

    def guidance_at(self, expert: int) -> float:
        return self.guidance if expert == 0 or self.guidance_2 is None else self.guidance_2


def condition_channels(config: dict[str, Any]) -> int:
    """Channels a transformer takes beside the latents it predicts (Wan 2.2 I2V: 36 in, 16
    out, so 20: the first-frame mask and the condition video); 0 for text to video."""
    return int(config["in_channels"]) - int(config.get("out_channels") or config["in_channels"])


def latent_shape(config: dict[str, Any], frames: int, height: int, width: int,
                 spatial_factor: int = VAE_SPATIAL_FACTOR,
                 temporal_factor: int = VAE_TEMPORAL_FACTOR) -> tuple[int, ...]:
    """``(1, C, F, H, W)`` latents for a video of ``frames`` x ``height`` x ``width`` pixels.

    Wan's VAE maps ``frames = tk + 1`` to ``k + 1`` latent frames (``t``: its
    ``temporal_factor``, 4) and divides height and width by ``spatial_factor`` (8; Wan 2.2's
    48-channel VAE: 16; the built-in digits-wan's: 4); the transformer then needs
    latent sizes divisible by its patch size. Sizes that do not fit are errors (diffusers
    rounds them; here nothing is silently changed).
    """
    patch = list(config.get("patch_size", (1, 2, 2)))
    # The latents are what the transformer predicts: an image-to-video transformer takes
    # condition channels beside them (Wan 2.2 I2V: in_channels 36, out_channels 16).
    channels = int(config.get("out_channels") or config["in_channels"])
    for name, value in (("frames", frames), ("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SamplerInputError(f"{name}={value!r}; expected a positive integer")
    t = temporal_factor
    if (frames - 1) % t != 0:
        lower = (frames - 1) // t * t + 1
        raise SamplerInputError(
            f"frames={frames}; expected {t}k+1 video frames (Wan's VAE keeps "
            f"the first frame and compresses the rest {t}x), e.g. {lower} or "
            f"{lower + t}"
        )
    latent_frames = (frames - 1) // t + 1
    if latent_frames % patch[0] != 0:
        raise SamplerInputError(
            f"frames={frames} gives {latent_frames} latent frames, not a multiple of the temporal "
            f"patch size {patch[0]}"
        )
    dims = [latent_frames]
    for name, value, p in (("height", height, patch[1]), ("width", width, patch[2])):
        multiple = spatial_factor * p
        if value % multiple != 0:
            lower = max(multiple, value // multiple * multiple)
            raise SamplerInputError(
                f"{name}={value}; expected a multiple of {multiple} (VAE factor "
                f"{spatial_factor} x patch size {p}), e.g. {lower} or {lower + multiple}"
            )
        dims.append(value // spatial_factor)
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
            f"{list(expected[1:])} or {list(expected)} (latent channels, one frame, and the "
            "latent height and width of the requested video)"
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


# -- memory -----------------------------------------------------------------------------------

_GIB = 1 << 30
# What the compiled model holds beside its IR weights (measured 1.2-1.5x, README).
COMPILED_WEIGHTS_FACTOR = 1.5
# Live f32 activations per video token and sample: about six hidden-width tensors (residual,
# norm, q, k, v, attention output) plus one feed-forward column block (FFN_COLUMN_BLOCK at
# export); measured 2.1-2.8 GiB for Wan 1.3B at 32,760 tokens, batch 2 (README).
ACTIVATION_WIDTHS = 6
FFN_BLOCK = 2048
# Latent-sized f32 arrays alive in the loop: noise, latents, the guidance batch, predictions,
# the scheduler's history.
LATENT_COPIES = 8


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run will hold, estimated before anything is allocated (bytes per part)."""

    tokens: int
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {value / _GIB:.2f} GiB" for name, value in self.parts.items())
        return f"{self.tokens:,} video tokens, about {self.total / _GIB:.2f} GiB ({parts})"


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def graph_weight_bytes(manifest: ModelManifest) -> int:
    return sum(d.size for name, d in manifest.record.files.items() if name.endswith(".bin"))


def estimate_memory(
    experts: Sequence[ModelManifest], shape: Sequence[int], text_length: int, workers: int,
    extra: dict[str, int] | None = None,
) -> MemoryEstimate:
    """The transformers' part of a run of ``shape`` latents; ``extra`` adds other parts."""
    config = experts[0].config
    tokens = video_tokens(config, shape)
    width = int(config.get("num_attention_heads", 1)) * int(config.get("attention_head_dim", 1))
    ffn = min(int(config.get("ffn_dim", width)), FFN_BLOCK)
    per_sample = (tokens * (ACTIVATION_WIDTHS * width + ffn) + 2 * text_length * width) * 4
    parts = {
        "weights": int(sum(graph_weight_bytes(m) for m in experts) * COMPILED_WEIGHTS_FACTOR)
        * workers,
        "activations": 2 * per_sample,
        "latents": int(np.prod(shape)) * 4 * LATENT_COPIES,
        **(extra or {}),
    }
    return MemoryEstimate(tokens=tokens, parts=parts)


def check_memory(estimate: MemoryEstimate, available: int | None = None) -> None:
    """Refuse a run the machine cannot hold, with the numbers."""
    available = available_memory() if available is None else available
    if available is not None and estimate.total > available:
        raise SamplerInputError(
            f"this video needs {estimate.describe()}, but {available / _GIB:.2f} GiB of memory "
            "is available; expected a smaller video (fewer frames, height or width)"
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
        self._compiled = manifest.compile_rank(0, config)
        # numaov's attention leaves no MHA snippet behind, so it needs no second compilation;
        # the compile says which kernel its attention nodes got.
        self.attention = self._compiled.attention
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

        from numaov.models.wan.transformer import WanTransformer

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


# -- schedules --------------------------------------------------------------------------------


class Schedule:
    """The timesteps of a run and the update from one to the next."""

    timesteps: list[float]

    def step(self, velocity: np.ndarray, index: int, latents: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class EulerSchedule(Schedule):
    """Flow-matching Euler with Wan's shift, in numpy (``flow_match_sigmas``)."""

    def __init__(self, steps: int, shift: float) -> None:
        self._sigmas = flow_match_sigmas(steps, shift)
        self.timesteps = [float(s * np.float32(NUM_TRAIN_TIMESTEPS)) for s in self._sigmas[:-1]]

    def step(self, velocity: np.ndarray, index: int, latents: np.ndarray) -> np.ndarray:
        dt = self._sigmas[index + 1] - self._sigmas[index]
        return (latents + dt * velocity).astype(np.float32)


class DiffusersSchedule(Schedule):
    """diffusers' own scheduler class, built from a pipeline's ``scheduler_config.json``.

    Wan's pipelines ship ``UniPCMultistepScheduler`` (a multistep predictor-corrector with
    ``flow_shift``); running that class rather than a copy of it keeps numaov's schedule the
    one diffusers' ``WanPipeline`` steps with, whatever options the config sets. It works on
    the latents only, a negligible cost beside the transformer.
    """

    def __init__(self, steps: int, config: dict[str, Any]) -> None:
        import diffusers
        import torch

        name = str(config.get("_class_name", ""))
        cls = getattr(diffusers, name, None) if name.endswith("Scheduler") else None
        if cls is None or not hasattr(cls, "from_config"):
            raise SamplerInputError(
                f"scheduler class {name!r} is not a diffusers scheduler; expected e.g. "
                "UniPCMultistepScheduler or FlowMatchEulerDiscreteScheduler"
            )
        self._torch = torch
        self._scheduler = cls.from_config(config)
        self._scheduler.set_timesteps(steps)
        self._scheduler.set_begin_index(0)
        self._steps = [t for t in self._scheduler.timesteps]
        self.timesteps = [float(t) for t in self._steps]

    def step(self, velocity: np.ndarray, index: int, latents: np.ndarray) -> np.ndarray:
        torch = self._torch
        out = self._scheduler.step(torch.from_numpy(velocity), self._steps[index],
                                   torch.from_numpy(latents), return_dict=False)[0]
        return out.numpy().astype(np.float32)


def make_schedule(request: WanSampleRequest) -> Schedule:
    if request.scheduler is not None:
        return DiffusersSchedule(request.steps, request.scheduler)
    return EulerSchedule(request.steps, request.shift)


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
    """What a guidance worker needs; plain data, so it pickles into a spawned process."""

    model_dirs: tuple[str, ...]  # one per expert
    backend: str
    branch_text: np.ndarray
    shape: tuple[int, ...]
    request: WanSampleRequest
    layout: TimestepLayout


def _guidance_rank(context: Any, job: _RankJob) -> tuple[np.ndarray, list[float]]:
    """Worker body: this rank's branch, every step joined with the other rank's."""
    from numaov.distributed.communicator import find_communicator

    denoisers = [open_denoiser(read_manifest(d, expected_kind="wan"), job.backend,
                               context.openvino_config()) for d in job.model_dirs]
    communicator = find_communicator(context.group)
    try:
        predictors = [GatheredGuidance(d, job.branch_text, communicator) for d in denoisers]
        return sample(predictors, job.shape, job.request, layout=job.layout)
    finally:
        for denoiser in denoisers:
            denoiser.close()


def validate_request(request: WanSampleRequest, backend: str, workers: int) -> None:
    if backend not in BACKENDS:
        raise _unknown_backend(backend)
    if workers not in (1, MAX_WORKERS):
        raise SamplerInputError(
            f"workers={workers}; expected 1 (both guidance branches in one batch) or "
            f"{MAX_WORKERS} (one branch per worker)", parameter="workers"
        )
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
    (:func:`numaov.runtime.placement.binding.plan_for_ranks`), each pinned with its own compiled model;
    ``workers=1`` runs in this process, unpinned (a set ``NUMAOV_CPU_BIND`` is still checked).
    ``first_frame_latents`` (a ``.npy`` of ``[C, 1, H', W']`` or ``[1, C, 1, H', W']``)
    conditions the video on its first latent frame (Wan 2.2 TI2V image-to-video); it needs a
    model exported with ``timestep="per-frame"``.
    """
    report = progress or (lambda _msg: None)
    validate_request(request, backend, workers)
    if request.guidance_2 is not None:
        raise SamplerInputError(
            f"guidance_2={request.guidance_2} is the second expert's guidance; expected it only "
            "with a prompt on a Wan 2.2 two-expert pipeline export", parameter="guidance_2"
        )
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
    layout = timestep_layout(
        manifest, shape,
        None if first_frame_latents is None
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
    check_memory(estimate_memory([manifest], shape, text.shape[0], workers))
    latents, seconds = denoise([manifest], plan, backend, text, negative, shape, request, layout,
                               progress)
    if out_path is not None:
        np.save(out_path, latents)
        report(f"wrote {out_path}")
    return SampleResult(latents=latents, backend=backend, workers=workers, step_seconds=seconds)


def denoise(
    experts: Sequence[ModelManifest],
    plan: BindingPlan | None,
    backend: str,
    text: np.ndarray,
    negative: np.ndarray,
    shape: tuple[int, ...],
    request: WanSampleRequest,
    layout: TimestepLayout,
    progress: Progress = None,
) -> tuple[np.ndarray, list[float]]:
    """The sampling loop on one worker (``plan`` None: in this process, both guidance
    branches in one batch) or on the plan's two workers (one branch each); ``experts`` are the
    transformers (one, or Wan 2.2's two)."""
    report = progress or (lambda _msg: None)
    workers = 1 if plan is None else MAX_WORKERS
    report(
        f"sampling latents {list(shape)} ({request.steps} steps, guidance {request.guidance}) on "
        f"{backend} with {workers} worker(s)"
    )
    if workers == 1:
        start = time.perf_counter()
        denoisers = [open_denoiser(manifest, backend) for manifest in experts]
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
        finally:
            for denoiser in denoisers:
                denoiser.close()
    else:
        from numaov.runtime.placement.workers import run_on_ranks

        jobs = [
            _RankJob(tuple(str(m.directory) for m in experts), backend, branch, tuple(shape),
                     request, layout)
            for branch in (text, negative)
        ]
        (latents, seconds), (other, _) = run_on_ranks(plan, _guidance_rank, jobs)
        # Both ranks apply the same update to the same gathered predictions, so they must
        # agree exactly; a difference would mean the gather mixed up rows or steps.
        if not np.array_equal(latents, other):
            raise GuidanceSplitError(
                "the two guidance workers ended with different latents; expected identical "
                "latents from the same gathered predictions"
            )
    report(f"sampled in {sum(seconds):.2f} s ({sum(seconds) / len(seconds):.2f} s per step)")
    return latents, seconds

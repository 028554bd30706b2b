"""The schedules a Wan sampler steps by: the timesteps of a run and the update between them.

- ``EulerSchedule``: ``FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=s)``
  followed by ``set_timesteps(N)``, reproduced exactly (``flow_match_sigmas``): N sigmas
  evenly spaced from 1 down to the shifted training minimum ``s*0.001 / (1 + (s-1)*0.001)``,
  each passed through Wan's shift ``sigma' = s*sigma / (1 + (s-1)*sigma)``, then a
  terminal 0. The model is given ``timestep = 1000 * sigma``. Wan 2.1 T2V uses ``s = 5``.
  Step: ``x <- x + (sigma_next - sigma) * v``, in f32.
- ``DiffusersSchedule``: a request carrying a diffusers scheduler config (a pipeline
  export's, see ``pipeline``) is stepped by that diffusers scheduler instead.

``scheduler_config`` picks the sampler at run time (``--scheduler unipc|euler``,
``--shift``), as a diffusers user swaps ``pipe.scheduler``: ``euler`` is
``FlowMatchEulerDiscreteScheduler(num_train_timesteps, shift)``, ``unipc`` the pipeline's
``UniPCMultistepScheduler`` config (or Wan's: ``flow_prediction`` with flow sigmas) with
``flow_shift``, the shift defaulting to the pipeline scheduler's own. Distilled LoRAs
(lightx2v's) ship such a recipe: 4 steps of Euler or UniPC at shift 5, guidance 1.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from numaov import exception_text
from numaov.runtime.wan.request import DEFAULT_SHIFT, SamplerInputError, WanSampleRequest

NUM_TRAIN_TIMESTEPS = 1000
SAMPLERS = ("unipc", "euler")
EULER_CLASS = "FlowMatchEulerDiscreteScheduler"
UNIPC_CLASS = "UniPCMultistepScheduler"
# Where each scheduler class keeps the timestep shift.
_SHIFT_KEYS = {EULER_CLASS: "shift", UNIPC_CLASS: "flow_shift"}


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
        try:
            self._scheduler = cls.from_config(config)
            self._scheduler.set_timesteps(steps)
        except (ValueError, TypeError, KeyError) as exc:  # e.g. use_dynamic_shifting, which
            # wants a resolution-dependent mu that diffusers' Wan pipelines never pass either
            raise SamplerInputError(
                f"the pipeline's scheduler {name} cannot set {steps} steps: "
                f"{exception_text(exc)}; "
                "expected a scheduler config diffusers' Wan pipeline runs") from None
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
    return EulerSchedule(request.steps, DEFAULT_SHIFT if request.shift is None else request.shift)


def check_shift(shift: float | None) -> None:
    if shift is not None and not (isinstance(shift, int | float) and math.isfinite(shift)
                                  and shift > 0):
        raise SamplerInputError(f"shift={shift}; expected a positive number (Wan uses 3.0 to "
                                "5.0, distilled LoRAs 5.0)", parameter="shift")


def check_sampler(sampler: str | None) -> None:
    if sampler is not None and sampler not in SAMPLERS:
        raise SamplerInputError(f"unknown sampler {sampler!r}; expected one of "
                                f"{', '.join(SAMPLERS)}", parameter="sampler")


def scheduler_config(sampler: str | None, shift: float | None,
                     base: dict[str, Any] | None) -> dict[str, Any] | None:
    """The diffusers scheduler config a run steps with: ``base`` (a pipeline export's
    ``scheduler_config.json``; None for latents from embeddings) changed to ``sampler`` and
    ``shift`` (None: keep the base's). None means flow-matching Euler in numpy
    (``EulerSchedule``, the same numbers as diffusers' class)."""
    check_sampler(sampler)
    check_shift(shift)
    if base is None:
        if sampler != "unipc":
            return None
        base = {"_class_name": UNIPC_CLASS, "num_train_timesteps": NUM_TRAIN_TIMESTEPS,
                "prediction_type": "flow_prediction", "use_flow_sigmas": True,
                "flow_shift": DEFAULT_SHIFT}
    name = str(base.get("_class_name", ""))
    wanted = {None: name, "euler": EULER_CLASS, "unipc": UNIPC_CLASS}[sampler]
    if shift is None and name != wanted:
        shift = _base_shift(base)
    if wanted == name:
        config = dict(base)
    elif wanted == EULER_CLASS:
        config = {"_class_name": EULER_CLASS,
                  "num_train_timesteps": base.get("num_train_timesteps", NUM_TRAIN_TIMESTEPS)}
    else:  # a pipeline shipping another scheduler, run with Wan's UniPC
        config = {"_class_name": UNIPC_CLASS,
                  "num_train_timesteps": base.get("num_train_timesteps", NUM_TRAIN_TIMESTEPS),
                  "prediction_type": "flow_prediction", "use_flow_sigmas": True}
    if shift is not None:
        key = _SHIFT_KEYS.get(wanted)
        if key is None:
            raise SamplerInputError(
                f"shift={shift} for the pipeline's scheduler {wanted!r}, whose shift numaov "
                f"does not set; expected a sampler of {', '.join(SAMPLERS)} with it",
                parameter="shift")
        config[key] = float(shift)
    return config


def _base_shift(base: dict[str, Any]) -> float | None:
    """The pipeline scheduler's shift (its class's default when its config has none)."""
    key = _SHIFT_KEYS.get(str(base.get("_class_name", "")))
    if key is None:
        return None
    return float(base.get(key, 1.0))

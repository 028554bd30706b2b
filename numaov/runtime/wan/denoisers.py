"""One Wan transformer behind one call, whichever backend runs it.

Backends: OpenVINO (the compiled IR, one infer request), ONNX Runtime (the ONNX file),
PyTorch (``numaov.models.wan.transformer`` on the exported checkpoint). All take and return
f32 numpy arrays behind ``Denoiser``, so no call site branches on the backend;
``open_denoiser`` opens the one named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from numaov.custom_ops.openvino_compile import InferError, WeightPages, infer
from numaov.models.wan import RANK_INPUT
from numaov.runtime.comparison import max_rel_error
from numaov.runtime.manifest_reader import ModelManifest
from numaov.runtime.wan.request import INPUT_NAMES, SamplerInputError, video_tokens

BACKENDS = ("openvino", "onnxruntime", "torch")
SAMPLE = "sample"  # the exported transformer's prediction


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


def sample_part(manifest: ModelManifest) -> Any:
    """The part of an export's graph that gives its sample alone (None: the graph gives
    nothing else): its block outputs (``BLOCK_OUTPUTS``) are for the step cache."""
    from numaov.custom_ops.openvino_compile import GraphPart

    return GraphPart((SAMPLE,)) if manifest.output_names != [SAMPLE] else None


class OpenVINODenoiser(Denoiser):
    """``sequence_rank``: this worker's index in a transformer split over sequence-parallel
    ranks (``runtime/wan/parallel.py``), fed to the split graph with every call."""

    name = "openvino"

    def __init__(self, manifest: ModelManifest, config: dict[str, Any] | None = None,
                 sequence_rank: int | None = None) -> None:
        self._manifest, self._config = manifest, dict(config or {})
        self._rank = ({} if sequence_rank is None else
                      {RANK_INPUT: np.array([sequence_rank], dtype=np.int64)})
        self._compiled = manifest.compile_rank(sequence_rank or 0, config,
                                               part=sample_part(manifest))
        # numaov's attention leaves no MHA snippet behind, so it needs no second compilation;
        # the compile says which kernel its attention nodes got.
        self.attention = self._compiled.attention
        self._request = self._compiled.create_infer_request()
        self._single_token_request = None
        # the IR's mapped weights, dropped after each compilation's first step has packed them
        self._weight_pages = WeightPages(manifest.rank(0).ir_xml.with_suffix(".bin"))

    def _request_for(self, hidden_states: np.ndarray) -> Any:
        if self.attention == "numaov":
            return self._request
        if video_tokens(self._manifest.config, hidden_states.shape) != 1:
            return self._request
        if self._single_token_request is None:
            compiled = self._manifest.compile_rank(0, {**self._config, **SINGLE_TOKEN_CONFIG},
                                                   part=sample_part(self._manifest))
            self._single_token_request = compiled.create_infer_request()
        return self._single_token_request

    def predict(
        self, hidden_states: np.ndarray, timestep: np.ndarray, text: np.ndarray
    ) -> np.ndarray:
        request = self._request_for(hidden_states)
        infer(request, {"hidden_states": hidden_states, "timestep": timestep,
                        "encoder_hidden_states": text, **self._rank})
        self._weight_pages.after_run(id(request))
        prediction = request.get_output_tensor(0)
        # The prediction has the latents' batch, frames and size (its channels may be fewer:
        # I2V's input carries the image's too). A split graph whose peer worker was killed
        # mid-step has been seen to return its unset, empty output instead of raising
        # (rarely, in tests that kill a worker): that is one line too, not a failure later.
        shape = tuple(prediction.shape)
        if len(shape) != hidden_states.ndim or shape[0] != hidden_states.shape[0] \
                or shape[2:] != hidden_states.shape[2:] or not shape[1]:
            raise InferError(f"OpenVINO returned a prediction of shape {list(shape)} for latents "
                             f"of shape {list(hidden_states.shape)}; expected the latents' batch, "
                             "frames and size (a sequence-parallel peer worker may have failed)")
        return np.array(prediction.data, dtype=np.float32)

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
            [SAMPLE],
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
        self._model = WanTransformer.from_pretrained(source, dtype=dtype,
                                                     loras=merged_loras(manifest))
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


def merged_loras(manifest: ModelManifest) -> list:
    """The LoRAs the export merged (its manifest's ``loras``), read again from their files for
    the PyTorch backend, each checked against the digest the export recorded."""
    from numaov.manifest import digest_file
    from numaov.models.wan.lora import LoraSpec, read_lora

    loras = []
    for entry in manifest.record.loras:
        path = Path(entry["path"])
        if not path.is_file() or digest_file(path).xxh3_128 != entry["xxh3_128"]:
            found = "is gone" if not path.is_file() else "changed since (its xxh3-128 differs)"
            raise SamplerInputError(
                f"the export merged LoRA {str(path)!r}, which {found}; the torch backend merges "
                "it again: expected the file the export read, or the openvino or onnxruntime "
                "backend", parameter="backend")
        loras.append(read_lora(LoraSpec(path, float(entry["scale"]))))
    return loras


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
    raise unknown_backend(backend)


def unknown_backend(backend: str) -> SamplerInputError:
    return SamplerInputError(
        f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}", parameter="backend"
    )


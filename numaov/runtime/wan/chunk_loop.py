"""diffusers' chunk loops with their caches made explicit: the VAE decoder's frame loop
(``wan_vae.VaeDecoder``) and the VAE encoder's chunk loop (``wan_image_condition``).

Each is a pair of exported graphs (``numaov.models.wan.components``): ``first`` runs on the
first chunk alone, ``following`` on every later chunk with the causal convolutions' caches the
call before returned. Output 0 of a call is its result; outputs 1, 2, ... (``cache_<i>``) are
the next call's inputs ``caches_<i>``.

On OpenVINO the caches stay OpenVINO tensors from one call to the next, bf16 at bf16
precision (``compile_ir(..., bf16_io=CACHE_PREFIXES)``), two requests of ``following`` taking
turns so the one running never writes what it reads. benchmarks/wan_pipeline.py's 17x256x256
decode carries 620 MB of f32 caches a call; handed over as tensors it took 8.0 s with f32
ones and 6.0 s with bf16 ones, where copying them through numpy (and the RMS norms' older
export) had taken 11.4 s. On ONNX Runtime and PyTorch they are numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from numaov.custom_ops.openvino_compile import WeightPages
from numaov.runtime.manifest_reader import ModelManifest
from numaov.runtime.wan.graph_runner import GraphRunner

# The caches' names in both graphs of a pair: inputs ``caches_i``, outputs ``cache_i``.
CACHE_PREFIXES = ("caches_", "cache_")


class _Joined:
    """Output 0 of every call joined along axis 2 as they come, into one array sized once
    the first two calls give the first chunk's and every later chunk's length (a list of
    results and a concatenation would hold the whole output twice)."""

    def __init__(self, chunks: int) -> None:
        self._chunks = chunks
        self._first: np.ndarray | None = None
        self._out: np.ndarray | None = None
        self._at = 0

    def add(self, result: np.ndarray) -> None:
        if self._first is None:
            self._first = np.array(result)  # a copy: an OpenVINO output is reused
            return
        if self._out is None:
            first, self._first = self._first, np.empty(0)
            shape = list(first.shape)
            shape[2] += (self._chunks - 1) * result.shape[2]
            self._out = np.empty(shape, first.dtype)
            self._out[:, :, :first.shape[2]] = first
            self._at = first.shape[2]
        self._out[:, :, self._at:self._at + result.shape[2]] = result
        self._at += result.shape[2]

    def result(self) -> np.ndarray:
        return self._first if self._out is None else self._out


class ChunkLoop:
    """``first`` then ``following`` over a sequence of chunks; ``inputs`` names each graph's
    chunk input. Returns output 0 of the calls joined along axis 2 (time)."""

    def __init__(self, first: ModelManifest, following: ModelManifest, backend: str,
                 config: dict[str, Any] | None = None,
                 inputs: tuple[str, str] = ("latents", "latents")) -> None:
        if backend == "openvino":
            self._run: Callable[[Sequence[np.ndarray]], list[np.ndarray]] = _OpenVinoChunks(
                first, following, config, inputs)
        else:
            self._run = _RunnerChunks(first, following, backend, config, inputs)

    def __call__(self, chunks: Sequence[np.ndarray]) -> np.ndarray:
        return self._run(chunks)


class _RunnerChunks:
    """The loop on ONNX Runtime or PyTorch: the caches as numpy arrays."""

    def __init__(self, first: ModelManifest, following: ModelManifest, backend: str,
                 config: dict[str, Any] | None, inputs: tuple[str, str]) -> None:
        self._first = GraphRunner(first, backend, config)
        self._following = GraphRunner(following, backend, config)
        self._inputs = inputs

    def __call__(self, chunks: Sequence[np.ndarray]) -> np.ndarray:
        result, *caches = self._first({self._inputs[0]: np.ascontiguousarray(chunks[0])})
        joined = _Joined(len(chunks))
        joined.add(result)
        for chunk in chunks[1:]:
            feeds = {self._inputs[1]: np.ascontiguousarray(chunk)}
            feeds.update({f"caches_{i}": cache for i, cache in enumerate(caches)})
            result, *caches = self._following(feeds)
            joined.add(result)
        return joined.result()


class _OpenVinoChunks:
    """The loop on OpenVINO, the caches handed from one call's output tensors to the next
    call's inputs."""

    def __init__(self, first: ModelManifest, following: ModelManifest,
                 config: dict[str, Any] | None, inputs: tuple[str, str]) -> None:
        self._first = first.compile_rank(0, config, bf16_io=CACHE_PREFIXES)
        self._following = following.compile_rank(0, config, bf16_io=CACHE_PREFIXES)
        self._caches = len(self._first.outputs) - 1
        self._inputs = inputs
        # both IRs' mapped weights, dropped once each graph has run (a one-chunk call runs
        # only the first)
        self._weight_pages = {
            graph: WeightPages(m.rank(0).ir_xml.with_suffix(".bin"))
            for graph, m in (("first", first), ("following", following))}

    def __call__(self, chunks: Sequence[np.ndarray]) -> np.ndarray:
        import openvino as ov

        previous = self._first.create_infer_request()
        previous.infer({self._inputs[0]: np.ascontiguousarray(chunks[0])})
        self._weight_pages["first"].after_run()
        joined = _Joined(len(chunks))
        joined.add(previous.get_output_tensor(0).data)
        turns = [self._following.create_infer_request() for _ in range(min(2, len(chunks) - 1))]
        for k, chunk in enumerate(chunks[1:], start=1):
            request = turns[k % len(turns)]
            request.set_tensor(self._inputs[1], ov.Tensor(np.ascontiguousarray(chunk)))
            for i in range(self._caches):
                request.set_tensor(f"caches_{i}", previous.get_output_tensor(i + 1))
            request.infer()
            self._weight_pages["following"].after_run()
            joined.add(request.get_output_tensor(0).data)
            previous = request
        return joined.result()

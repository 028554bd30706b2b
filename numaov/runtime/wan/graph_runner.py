"""One exported component graph on one backend, behind one call.

``GraphRunner(manifest, backend, config)`` runs a component of a pipeline export (the text
encoder, the VAE decoder's graphs) on OpenVINO (the IR, compiled the one way numaov compiles,
with ``config``'s properties: a worker's threads and pinning), ONNX Runtime (the ONNX file) or
PyTorch (the source checkpoint through ``numaov.models.wan.components``): named numpy arrays
in, the graph's outputs in order out, so no call site branches on the backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from numaov.custom_ops.openvino_compile import WeightPages
from numaov.runtime.manifest_reader import ModelManifest

GRAPH_BACKENDS = ("openvino", "onnxruntime", "torch")


class GraphRunner:
    """A component graph on OpenVINO, ONNX Runtime or PyTorch."""

    def __init__(self, manifest: ModelManifest, backend: str,
                 config: Mapping[str, Any] | None = None) -> None:
        if backend not in GRAPH_BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")
        self.backend = backend
        if backend == "openvino":
            self._run = manifest.compile_rank(0, config).runner()
            # the IR's mapped weights, let go after the first call has packed them (UMT5-XXL's
            # are 11 GB)
            self._weight_pages = WeightPages(manifest.rank(0).ir_xml.with_suffix(".bin"))
        elif backend == "onnxruntime":
            import onnxruntime as ort

            options = ort.SessionOptions()
            threads = (config or {}).get("INFERENCE_NUM_THREADS")
            if threads:
                options.intra_op_num_threads = int(threads)
            self._session = ort.InferenceSession(str(manifest.rank(0).onnx), options,
                                                 providers=["CPUExecutionProvider"])
        else:
            from numaov.models.wan.components import GraphInputs, load_component

            source = manifest.source_checkpoint_dir("openvino or onnxruntime")
            self._module = GraphInputs(load_component(manifest.kind, source))

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.backend == "openvino":
            outputs = self._run(feeds)
            self._weight_pages.after_run()
            return outputs
        if self.backend == "onnxruntime":
            return [np.asarray(out) for out in self._session.run(None, feeds)]
        import torch

        with torch.inference_mode():
            out = self._module(**{k: torch.from_numpy(v) for k, v in feeds.items()})
        return [t.float().numpy() for t in (out if isinstance(out, tuple) else (out,))]

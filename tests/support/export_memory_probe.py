"""Run ``numaov export wan`` in this process and print its peak anonymous memory (MiB); or,
``load``, run an exported transformer's denoiser twice and print how much of its IR's
``.bin`` is resident after each step.

``RssAnon`` is sampled every 5 ms from ``/proc/self/status``: the private memory the export
allocates (models, graphs, compiled weights), not the file pages it maps (the checkpoint,
the ONNX data, the IR), which the kernel can drop. Used by the export memory tests, each
export in a fresh process so one's peak does not hide in another's heap.

    python tests/support/export_memory_probe.py CHECKPOINT OUT PRECISION
    python tests/support/export_memory_probe.py load MODEL_DIR
"""

from __future__ import annotations

import json
import sys
import threading
import time


def anonymous_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(checkpoint: str, out: str, precision: str) -> None:
    from numaov.exporter.wan_export import export_wan

    peak, done = [anonymous_mib()], threading.Event()
    baseline = peak[0]

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_mib())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    export_wan(checkpoint, out, precision=precision, force=True)
    done.set()
    sampler.join()
    print(json.dumps({"peak_mib": peak[0], "baseline_mib": baseline}))


def resident_mib(path: str) -> float:
    """This process's resident pages of the mappings of ``path`` (``smaps``), MiB."""
    import os

    target, total, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                inside = len(head) >= 6 and head[5] == target
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total / 1024


def load(model_dir: str) -> None:
    import numpy as np

    from numaov.runtime.manifest_reader import read_manifest
    from numaov.runtime.wan.denoisers import OpenVINODenoiser

    manifest = read_manifest(model_dir)
    weights = str(manifest.rank(0).ir_xml.with_suffix(".bin"))
    denoiser = OpenVINODenoiser(manifest, {"INFERENCE_NUM_THREADS": 1})
    config = manifest.config
    rng = np.random.default_rng(0)
    inputs = (rng.standard_normal((1, config["in_channels"], 2, 8, 8), dtype=np.float32),
              np.array([500.0], dtype=np.float32),
              rng.standard_normal((1, 7, config["text_dim"]), dtype=np.float32))
    compiled = resident_mib(weights)
    first = denoiser.predict(*inputs)
    after_first = resident_mib(weights)
    second = denoiser.predict(*inputs)
    print(json.dumps({"compiled_mib": compiled, "after_first_mib": after_first,
                      "after_second_mib": resident_mib(weights),
                      "same": bool(np.array_equal(first, second))}))


if __name__ == "__main__":
    if sys.argv[1] == "load":
        load(sys.argv[2])
    else:
        main(*sys.argv[1:4])

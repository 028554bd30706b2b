"""Run ``numaov export wan`` in this process and print its peak anonymous memory (MiB).

``RssAnon`` is sampled every 5 ms from ``/proc/self/status``: the private memory the export
allocates (models, graphs, compiled weights), not the file pages it maps (the checkpoint,
the ONNX data, the IR), which the kernel can drop. Used by the export memory tests, each
export in a fresh process so one's peak does not hide in another's heap.

    python tests/support/export_memory_probe.py CHECKPOINT OUT PRECISION
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


if __name__ == "__main__":
    main(*sys.argv[1:4])

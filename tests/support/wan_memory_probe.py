"""Run in a fresh process by the memory-estimate test: ``python wan_memory_probe.py EXPORT
HEIGHT WIDTH FRAMES OUT`` runs one small video (graphs compiled, OpenVINO's threads started),
then the asked one while a thread samples the process's anonymous resident memory every 10 ms,
and prints one JSON line: the run's estimate (bytes) and its measured growth over the warm
process (bytes)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from numaov.runtime.wan.pipeline import run_wan_pipeline
from numaov.runtime.wan.request import WanSampleRequest


def anonymous_rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(export: str, height: int, width: int, frames: int, out: str) -> None:
    run_wan_pipeline(export, WanSampleRequest(frames=1, height=64, width=64, steps=1,
                                              guidance=5.0, seed=0), "a", out)
    base = anonymous_rss()
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_rss())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    estimates: list[str] = []
    try:
        run_wan_pipeline(export, WanSampleRequest(frames=frames, height=height, width=width,
                                                  steps=1, guidance=5.0, seed=0),
                         "a w1", out, progress=estimates.append)
    finally:
        done.set()
        sampler.join()
    from numaov.runtime.wan.pipeline import estimate_pipeline_memory, read_pipeline
    from numaov.runtime.wan.request import latent_shape
    from numaov.runtime.wan.vae import VaeGeometry

    pipeline = read_pipeline(export)
    geometry = VaeGeometry.of(pipeline.components["vae_decoder/first_frame"])
    shape = latent_shape(pipeline.components["transformer"].config, frames, height, width,
                         geometry.spatial, geometry.temporal)
    estimate = estimate_pipeline_memory(pipeline, shape, 1, 2)
    print(json.dumps({"estimate": estimate.total, "growth": peak[0] - base,
                      "described": estimates[0]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

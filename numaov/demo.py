"""`numaov demo`: the built-in models exported, run on PyTorch and OpenVINO, and compared.

A library module: each section exports (or reuses) one built-in model, runs it and returns
its result lines and speed-table rows; `speed_table` and `slow_note` return strings; only
`cli.cmd_demo` prints. Progress goes to a `ProgressLine`, one phase per export or run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from numaov import NumaovError
from numaov.console import Phase, ProgressLine

# The digits grid: one clip per digit (directions in turn), 2 rows of 5, each shown 4x.
GRID_COLUMNS, GRID_SCALE = 5, 4
# The language model's prompts: openings from Python's documentation, and their length.
LM_PROMPTS = ("The with statement", "A list comprehension", "Exceptions are",
              "The import system")
LM_TOKENS = 24


class SpeedRow(NamedTuple):
    """One row of the table: what was timed (ending "(ms)" when lower is faster), parity."""

    what: str
    parity: str
    torch: float
    openvino: float

    @property
    def openvino_speedup(self) -> float:
        """OpenVINO's speed against torch: above 1.0 when OpenVINO is faster."""
        return self.torch / self.openvino if self.what.endswith("(ms)") else \
            self.openvino / self.torch


@dataclasses.dataclass(frozen=True)
class DemoSection:
    """What one built-in model's part of the demo prints, and its rows of the table."""

    lines: list[str]
    rows: list[SpeedRow]


def machine_lines() -> list[str]:
    """The machine the demo runs on (CPU, NUMA nodes, cores, ISA), then doctor's warnings."""
    from numaov.runtime.doctor import collect_report

    report = collect_report()
    topo = report["topology"]
    return [f"machine: {report['openvino'].get('cpu') or 'CPU'}, {len(topo['numa_nodes'])} "
            f"NUMA node(s), {topo['physical_cores']} physical core(s); ISA: "
            f"{report['isa']['bf16_matmuls']}",
            *(f"warning: {warning}" for warning in report["warnings"])]


def cached_export(out: Path, read: Callable[[Path], object], export: Callable[[bool], object],
                  phase: Phase) -> bool:
    """Reuse the export in ``out`` when it reads back; else export (again). True if reused."""
    from numaov.exporter.output_dir import holds_export

    again = ""
    if (out / "manifest.json").is_file():
        try:
            read(out)
            phase.finish(f"reusing the export in {out}")
            return True
        except NumaovError as exc:
            again = f" again ({exc})"
    # replace only an export (an older numaov's, or a broken one): anything else is refused
    export(holds_export(out))
    phase.finish(f"exported{again} to {out}")
    return False


def wan_export(out_dir: Path, line: ProgressLine) -> Path:
    """The built-in digits pipeline's export, ``out_dir/wan/model``: the one there when it
    reads back, else made (f32, decomposed ops)."""
    from numaov.exporter.wan_export import export_wan
    from numaov.models.builtin import DIGITS_WAN_DIR
    from numaov.runtime.wan.pipeline import read_pipeline

    model = out_dir / "wan" / "model"
    with line.phase("digits-wan: export") as phase:
        cached_export(model, read_pipeline,
                      lambda force: export_wan(DIGITS_WAN_DIR, model, "f32", "decomposed", phase,
                                               force=force), phase)
    return model


def lm_export(out_dir: Path, line: ProgressLine) -> Path:
    """The built-in tiny MoE's export for dp=2, ``out_dir/deepseek/model``: the one there when
    it reads back, else made (f32)."""
    from numaov.exporter.lm_export import export_lm
    from numaov.models.builtin import TINY_MOE_DIR
    from numaov.runtime.lm.engine import open_lm_manifest

    model = out_dir / "deepseek" / "model"
    with line.phase("tiny-moe: export for dp=2") as phase:
        cached_export(model, lambda d: open_lm_manifest(d, "openvino"),
                      lambda force: export_lm(TINY_MOE_DIR, model, dp=2, precision="f32",
                                              progress=phase, force=force), phase)
    return model


def wan_section(out_dir: Path, line: ProgressLine) -> DemoSection:
    """The built-in digits pipeline: export, one clip per digit on OpenVINO into a grid GIF,
    and one prompt on torch and OpenVINO for parity and per-step time."""
    import numpy as np

    from numaov.models.builtin.digit_clips import (
        DIRECTIONS,
        FRAMES,
        SAMPLING_GUIDANCE,
        SAMPLING_STEPS,
        SIZE,
        prompt_for,
    )
    from numaov.runtime.comparison import max_rel_error
    from numaov.runtime.wan.clip_grid import tile_clips
    from numaov.runtime.wan.pipeline import run_wan_pipeline
    from numaov.runtime.wan.request import WanSampleRequest
    from numaov.runtime.wan.video_output import write_video

    model = wan_export(out_dir, line)
    request = WanSampleRequest(frames=FRAMES, height=SIZE, width=SIZE, steps=SAMPLING_STEPS,
                               guidance=SAMPLING_GUIDANCE, seed=0)
    names = list(DIRECTIONS)
    clips, runs = [], {}
    scratch = out_dir / "wan" / "clips"
    scratch.mkdir(parents=True, exist_ok=True)
    with line.phase("digits-wan: one clip per digit on openvino") as phase:
        for digit in range(10):
            prompt = prompt_for(digit, names[digit % len(names)])
            video = run_wan_pipeline(model, dataclasses.replace(request, seed=digit), prompt,
                                     scratch / f"{digit}.gif",
                                     progress=lambda m, d=digit: phase(f"clip {d + 1}/10: {m}"))
            clips.append(video.frames)
            if digit == 3:
                runs["openvino"] = video
        phase.finish(f"{len(clips)} clips")
    with line.phase("digits-wan: the digit 3 on torch") as phase:
        runs["torch"] = run_wan_pipeline(model, dataclasses.replace(request, seed=3),
                                         prompt_for(3, names[3]), scratch / "3_torch.gif",
                                         backend="torch", progress=phase)
    grid = tile_clips(np.stack(clips), GRID_COLUMNS, GRID_SCALE)
    gif = out_dir / "digits.gif"
    write_video(grid, gif, fps=4)
    step = {b: float(np.median(r.sample.step_seconds[1:] or r.sample.step_seconds))
            for b, r in runs.items()}
    error = max_rel_error(runs["openvino"].frames, runs["torch"].frames)
    lines = [
        "digits-wan (built in, trained on scikit-learn's digits):",
        f"  wrote {gif}: {FRAMES} frames of {grid.shape[2]}x{grid.shape[1]}, digits 0-9 in "
        f"{len(clips) // GRID_COLUMNS} rows of {GRID_COLUMNS} ({SIZE}x{SIZE} clips shown "
        f"{GRID_SCALE}x), {SAMPLING_STEPS} steps, guidance {SAMPLING_GUIDANCE:g}",
    ]
    row = SpeedRow("digits-wan denoising step (ms)", f"{error:.1e} (frames)",
                   step["torch"] * 1e3, step["openvino"] * 1e3)
    return DemoSection(lines, [row])


def lm_section(out_dir: Path, line: ProgressLine) -> DemoSection:
    """The built-in tiny MoE: export for dp=2, complete a few prompts on two workers with
    OpenVINO and torch, compare tokens, logits and speed."""
    from numaov.models.builtin import TINY_MOE_DIR
    from numaov.runtime.comparison import GenerationComparison
    from numaov.runtime.lm.engine import encode_prompts, load_tokenizer, run_lm

    model = lm_export(out_dir, line)
    tokenizer = load_tokenizer(TINY_MOE_DIR)
    prompts = encode_prompts(tokenizer, LM_PROMPTS)
    runs = {}
    for backend in ("openvino", "torch"):
        with line.phase(f"tiny-moe: {len(prompts)} prompts on {backend}") as phase:
            runs[backend] = run_lm(model, prompts, LM_TOKENS, backend, keep_logits=True,
                                   tokenizer=tokenizer, progress=phase)
    comparison = GenerationComparison(runs["torch"], runs["openvino"])
    lines = ["tiny-moe (built in, trained on Python's documentation), DP attention on 2 ranks "
             f"({runs['openvino'].placement}):"]
    for text, tokens in zip(LM_PROMPTS, runs["openvino"].tokens, strict=True):
        completion = tokenizer.decode(tokens).replace("\n", " ")
        lines.append(f"  {text!r} -> {completion!r}")
    error = comparison.logits_max_rel_error
    parity = (f"{comparison.same_prompts}/{len(prompts)} same tokens, logits "
              f"{error:.1e}" if error is not None else "")
    rates = {b: r.decode_tokens_per_second for b, r in runs.items()}
    row = SpeedRow("tiny-moe dp=2 decode (tokens/s)", parity, rates["torch"], rates["openvino"])
    return DemoSection(lines, [row])


def run_sections(out_dir: Path, line: ProgressLine | None = None) -> Iterator[DemoSection]:
    """Each built-in model's section in turn, as it finishes; exports go under ``out_dir``."""
    line = line or ProgressLine(None)
    out_dir.mkdir(parents=True, exist_ok=True)
    for section in (wan_section, lm_section):
        yield section(out_dir, line)


def speed_table(rows: list[SpeedRow]) -> list[str]:
    """One table: what was timed, parity, torch, OpenVINO, OpenVINO's speed against torch."""
    header = ("", "parity (OpenVINO vs torch)", "torch", "OpenVINO", "OpenVINO/torch")
    body = [(r.what, r.parity, f"{r.torch:.1f}", f"{r.openvino:.1f}",
             f"{r.openvino_speedup:.2f}x") for r in rows]
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in (header, *body)]


def slow_note(rows: list[SpeedRow]) -> str | None:
    """Why OpenVINO is slower than torch here, when it is."""
    if all(r.openvino_speedup >= 1.0 for r in rows):
        return None
    return ("OpenVINO below 1.0x: at this size a step is a few small matrix products, so each "
            "graph call's fixed cost (input binding, output copies, thread wake-up) outweighs "
            "its faster kernels; `numaov bench` shows the gap close as sizes grow.")

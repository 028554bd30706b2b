"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A full run writes about 2.5 GB under pytest's base directory (exports, checkpoints, videos);
# below this much free space it would fail part-way with "No space left on device" from inside
# a writer, so the session refuses at the start with the numbers instead.
FREE_BYTES_NEEDED = 4 * 1024**3


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    import shutil
    import tempfile

    base = Path(session.config.option.basetemp or tempfile.gettempdir()).absolute()
    while not base.exists():  # --basetemp names a directory pytest has not made yet
        base = base.parent
    free = shutil.disk_usage(base).free
    if free < FREE_BYTES_NEEDED:
        pytest.exit(f"{base} has {free / 1024**3:.1f} GiB free; the tests write about 2.5 GB "
                    f"there and need {FREE_BYTES_NEEDED / 1024**3:.0f} GiB: free some space or "
                    "set --basetemp (or TMPDIR) to a larger disk", returncode=3)


@pytest.fixture
def two_cpus() -> tuple[int, int]:
    """Two CPUs this process may use, for emulating two NUMA-pinned ranks."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 allowed CPUs, this process has {allowed}")
    return allowed[0], allowed[1]


@pytest.fixture(scope="session")
def deepseek_bind() -> str:
    """NUMAOV_CPU_BIND for the DeepSeek dp=2 tests: one rank on each of two CPUs."""
    from support.deepseek_harness import two_cpu_bind_string

    bind = two_cpu_bind_string()
    if bind is None:
        pytest.skip(f"needs 2 allowed CPUs, this process has {sorted(os.sched_getaffinity(0))}")
    return bind


@pytest.fixture(scope="session")
def deepseek_exported(tmp_path_factory: pytest.TempPathFactory, deepseek_bind: str) -> dict:
    """The tiny DeepSeek-V2 exported once for dp=2 (deepseek_harness.export_tiny_dp2)."""
    from support.deepseek_harness import export_tiny_dp2

    return export_tiny_dp2(tmp_path_factory.mktemp("deepseek_export"), deepseek_bind)


WAN_PIPELINE_SEED = 3


@pytest.fixture(scope="session")
def wan_pipeline_exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Wan 2.1 pipeline (wan_pipeline_harness) exported once through the CLI, shared by
    the pipeline tests and the service's video tests (an export takes about a minute).
    ``pipe`` is the diffusers pipeline it was exported from."""
    import subprocess
    import sys

    from support.wan_pipeline_harness import build_tiny_pipeline

    root = tmp_path_factory.mktemp("wan_pipeline_export")
    pipe = build_tiny_pipeline(root / "pipeline", seed=WAN_PIPELINE_SEED)
    proc = subprocess.run([sys.executable, "-m", "numaov.cli", "export", "wan", "--checkpoint",
                           str(root / "pipeline"), "--out", str(root / "export"), "--quiet"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return {"root": root, "pipe": pipe, "export": root / "export", "summary": proc.stdout}


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built as the Makefile builds (without build isolation, against
    this venv's OpenVINO wheel) and installed without extras into a clean venv, as a user
    gets it; returns the venv."""
    import subprocess
    import sys

    root, work = Path(__file__).resolve().parents[1], tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-w", str(work / "wheels"), str(root)],
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (work / "wheels").glob("numaov-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # --no-compile: the modules run here are compiled as they are imported; compiling every
    # installed file first (torch's, transformers') took two thirds of the install (71 -> 24 s)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              "--no-compile", str(wheel), "torch==2.13.0"],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    return venv


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory, installed_wheel: Path) -> dict:
    """``numaov demo`` run once from the installed wheel (``installed_wheel``; its working
    directory outside the repository, so the installed package is the one imported), both
    built-in models exported into ``out`` (``wan/model``, ``deepseek/model``): for
    test_builtin_models.py and, as exports already made, test_notebooks.py."""
    import subprocess

    from support.deepseek_harness import two_cpu_bind_string

    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ)
    if (bind := two_cpu_bind_string()) is not None:
        env["NUMAOV_CPU_BIND"] = bind
    proc = subprocess.run([str(installed_wheel / "bin" / "numaov"), "demo", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=out)
    assert proc.returncode == 0, proc.stderr
    return {"out": out, "stdout": proc.stdout, "stderr": proc.stderr, "env": env}


@pytest.fixture(scope="session")
def wan(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Wan exported once (f32, through the CLI), plus text embedding files
    (wan_harness.export_tiny_wan), shared by the test_wan_{export,sampler,denoisers,cli,bench}
    tests; samples made with it are kept in it (wan_harness.sample_latents)."""
    from support.wan_harness import export_tiny_wan

    return export_tiny_wan(tmp_path_factory.mktemp("wan"))


@pytest.fixture(scope="session")
def ti2v(wan: dict) -> dict:
    """``wan``'s checkpoint exported with per-frame timesteps, and first-frame latents
    (wan_harness.export_per_frame). test_wan_pipeline_ti2v.py has a ``ti2v`` of its own."""
    from support.wan_harness import export_per_frame

    return export_per_frame(wan)

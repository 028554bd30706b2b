"""An export's output directory: written whole or not at all, and the records it holds.

An export writes into a fresh staging directory beside ``out_dir``
(``.<name>.partial-XXXXXX``) and renames it into place only once parity passed and the
manifest is written (`staged_output`). So:

- a failed or interrupted export leaves nothing in ``out_dir`` (its staging directory is
  removed; a killed process leaves only the hidden ``.partial-`` directory);
- a re-export replaces the previous export whole, so no stale file of it survives;
- an existing ``out_dir`` that is not a numaov export (no ``manifest.json``) and is not empty
  is refused unless ``force``: replacing it would delete the user's files.

The two renames (old export aside, new one in) are each atomic; between them ``out_dir``
briefly does not exist, which a reader reports as "does not exist" rather than reading a mix.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from numaov import NumaovError
from numaov.manifest import MANIFEST_NAME, FileDigest, digest_files


class OutputDirError(NumaovError):
    """The export's output directory cannot be used or written."""


def holds_export(directory: Path) -> bool:
    """Whether ``directory`` holds a numaov export: a ``manifest.json`` that is numaov's (a
    JSON object with its ``kind`` and ``format_version``), not merely a file of that name (web
    apps and browser extensions have one too)."""
    try:
        data = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("kind"), str) \
        and "format_version" in data


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse an output directory an export must not replace; called before any slow work."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(
            f"output {str(out_dir)!r} is a file; expected a directory", parameter="out"
        )
    if (
        out_dir.is_dir()
        and not force
        and not holds_export(out_dir)
        and any(out_dir.iterdir())
    ):
        raise OutputDirError(
            f"output directory {str(out_dir)!r} is not empty and holds no numaov export "
            f"({MANIFEST_NAME}); an export replaces its whole output directory: expected an "
            "empty or new directory, or a previous export (force replaces it anyway)",
            parameter="out",
        )


@contextlib.contextmanager
def staged_output(out_dir: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a staging directory to write the export into; on a clean exit (the manifest
    written), it replaces ``out_dir``; on an exception it is removed."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, force)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    except OSError as exc:
        raise OutputDirError(
            f"cannot create a directory beside {str(out_dir)!r} ({exc.strerror})",
            parameter="out",
        ) from exc
    # mkdtemp makes the directory private (0700); an export is as readable as any new folder.
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        yield staging
        if not (staging / MANIFEST_NAME).is_file():
            raise OutputDirError(f"the export wrote no {MANIFEST_NAME}; nothing was published")
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, out_dir: Path) -> None:
    old = None
    try:
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            old.rmdir()  # a free name on the same file system; rename needs it absent
            out_dir.rename(old)
        staging.rename(out_dir)
    except OSError as exc:
        if old is not None and not out_dir.exists():
            old.rename(out_dir)  # put the previous export back
        raise OutputDirError(f"cannot move the export into {str(out_dir)!r} ({exc})") from exc
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def digest_export(staging: Path, skip: Iterable[str] = ()) -> dict[str, FileDigest]:
    """The manifest's ``files``: every file the export wrote except the manifest itself and
    ``skip`` (the expert stores, which carry a digest per layer in their own header). The
    manifests of graphs in subdirectories (a transformer's ``sequence_<N>/``) are files of
    this export like the others: ``--reuse`` takes them with it."""
    skipped = {MANIFEST_NAME, *skip}
    names = [
        name for path in staging.rglob("*")
        if path.is_file() and (name := path.relative_to(staging).as_posix()) not in skipped
    ]
    return digest_files(staging, names)


def write_reference_sample(
    path: str | Path, inputs: dict[str, Any], outputs: dict[str, Any]
) -> Path:
    """Save one input set and PyTorch's outputs on it (the manifest's ``reference_sample``)."""
    import numpy as np

    from numaov.arrays import BFLOAT16

    path = Path(path)
    arrays = {f"input.{k}": v for k, v in inputs.items()}
    arrays.update({f"output.{k}": v for k, v in outputs.items()})
    # np.load reads bf16 back as bytes ("V2"): stored widened to f32 (exactly), which
    # compile_ir's runner rounds back for a bf16 input
    arrays = {k: v.astype(np.float32) if v.dtype == BFLOAT16 else v for k, v in arrays.items()}
    try:
        with path.open("wb") as handle:
            np.savez(handle, **arrays)
    except OSError as exc:
        raise OutputDirError(f"cannot write {str(path)!r} ({exc})") from exc
    return path


def library_versions() -> dict[str, str]:
    """Versions of the libraries an export depends on, recorded so a mismatch can be diagnosed."""
    import onnx
    import onnxruntime
    import openvino
    import torch

    import numaov

    return {
        "numaov": numaov.__version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "openvino": openvino.get_version(),
    }

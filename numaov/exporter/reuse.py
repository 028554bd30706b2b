"""Components of an earlier Wan export taken as they are when nothing they come from changed.

Every exported Wan graph's manifest records ``source_digest``: an xxh3-128 over what shapes
the graph (its kind, precision, lowering, timestep, the LoRAs merged into it with their
digests and scales), the code that exports it (the library versions and a digest of numaov's
own modules and native library), and every file of the checkpoint directory it was read from
(name, size and content digest: every export reads its checkpoint once more for it, at about
disk speed). ``numaov export wan --reuse PREVIOUS`` takes each component of ``PREVIOUS``
whose digest equals the one about to be exported, and whose files still hold what their
export wrote, into the new export (hard links, copies across file systems) instead of
exporting it again: a pipeline re-exported with
another LoRA exports its transformer only, not UMT5-XXL and the VAE again. A component that
differs, is missing or whose files changed since is exported as usual, and the report says
which were taken.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from numaov import NumaovError
from numaov.exporter.output_dir import OutputDirError, library_versions
from numaov.manifest import MANIFEST_NAME, ExportManifest, ModelDirError, digest_file
from numaov.native import library_path


class ReuseError(NumaovError):
    """``--reuse`` names something that is not a numaov export."""


def source_digest(source: Path, options: Mapping[str, Any],
                  files: str | None = None) -> str:
    """The digest of what a graph is exported from: ``options`` (JSON-able), the code that
    builds it (``exporter_versions``), and every file under ``source`` (``files``: their
    ``files_digest``, when already taken)."""
    import xxhash

    hasher = xxhash.xxh3_128()
    hasher.update(json.dumps({"options": dict(options), "versions": exporter_versions()},
                             sort_keys=True).encode())
    hasher.update((files or files_digest(source)).encode())
    return hasher.hexdigest()


def files_digest(source: Path) -> str:
    """Every file under ``source``: its relative name, size and content."""
    import xxhash

    hasher = xxhash.xxh3_128()
    try:
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            digest = digest_file(path)
            hasher.update(f"{path.relative_to(source)}\0{digest.size}\0{digest.xxh3_128}\n"
                          .encode())
    except OSError as exc:
        raise ReuseError(f"cannot read the checkpoint's {exc.filename!r} ({exc.strerror}); "
                         "expected readable files", parameter="checkpoint") from exc
    return hasher.hexdigest()


@functools.cache
def exporter_versions() -> dict[str, str]:
    """What builds a graph besides its checkpoint: the recorded library versions, the model
    libraries' (transformers, diffusers, onnxscript) and a digest of numaov's own code (its
    modules and native library: a changed model or exporter changes the graph, whatever the
    version number says)."""
    import importlib.metadata

    import xxhash

    import numaov

    versions = dict(library_versions())
    for name in ("transformers", "diffusers", "onnxscript"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    code = xxhash.xxh3_128()
    package = Path(numaov.__file__).parent
    for path in sorted(package.rglob("*.py")):
        code.update(f"{path.relative_to(package)}\0{digest_file(path).xxh3_128}\n".encode())
    code.update(digest_file(library_path()).xxh3_128.encode())  # the custom ops' library
    versions["numaov_code"] = code.hexdigest()
    return versions


def check_previous(previous: str | Path | None) -> Path | None:
    """``--reuse``'s directory, refused before any work unless it holds a numaov export."""
    if previous is None:
        return None
    previous = Path(previous)
    if not (previous / MANIFEST_NAME).is_file():
        raise ReuseError(
            f"--reuse {str(previous)!r} holds no {MANIFEST_NAME}; expected the output "
            "directory of an earlier `numaov export wan`", parameter="reuse")
    return previous


class ComponentReuse:
    """Exports each graph, or takes it from ``previous`` (None: always exports) where it is
    the same; ``report`` says which were taken."""

    def __init__(self, previous: Path | None, report: Callable[[str], None]) -> None:
        self.previous = previous
        self.report = report
        # each source directory read once per export (a VAE gives two to four graphs)
        self._files: dict[Path, str] = {}

    def export(self, name: str, out_dir: Path, source: Path, options: Mapping[str, Any],
               build: Callable[[], ExportManifest],
               loras: list[dict[str, Any]] | None = None) -> ExportManifest:
        """The graph ``name`` (its directory relative to the export's root, "" for a bare
        transformer export) in ``out_dir``: ``previous``'s when its ``source_digest`` matches,
        else ``build()``'s (which writes ``out_dir``), with the digest recorded. A graph taken
        gets this export's ``source`` and ``loras`` (their records) in its manifest: the same
        contents, maybe found elsewhere now."""
        if source not in self._files:
            self._files[source] = files_digest(source)
        digest = source_digest(source, options, self._files[source])
        manifest = self._take(name, digest, out_dir)
        if manifest is None:
            manifest = build()
        else:
            manifest.source_checkpoint = str(source.resolve())
            if loras is not None:
                manifest.loras = loras
        manifest.source_digest = digest
        manifest.write(out_dir)  # a new file: the earlier export's linked one is left as it is
        return manifest

    def _take(self, name: str, digest: str, out_dir: Path) -> ExportManifest | None:
        if self.previous is None:
            return None
        directory = self.previous / name
        label = name or "transformer"
        if not (directory / MANIFEST_NAME).is_file():
            return None  # the earlier export has no such graph
        try:
            manifest = ExportManifest.read(directory)
            if manifest.source_digest != digest:
                return None
            for file in manifest.files:
                manifest.verify_file(directory, file)
        except (ModelDirError, OSError) as exc:
            self.report(f"{label}: not reused, {exc}")
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        for file in manifest.files:
            _link(directory / file, out_dir / file)
        self.report(f"{label}: reused from {directory} (same checkpoint files and options)")
        return manifest


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        try:
            shutil.copy2(source, target)
        except OSError as exc:
            raise OutputDirError(f"cannot copy {str(source)!r} into the export "
                                 f"({exc.strerror})", parameter="out") from exc

"""Components of an earlier Wan export taken as they are when nothing they come from changed.

Every exported Wan graph's manifest records ``source_digest``: an xxh3-128 over what shapes
the graph (its kind, precision, lowering, timestep, the LoRAs merged into it with their
digests and scales), the numaov and library versions that export it, and every file of the
checkpoint directory it was read from (name, size and content digest). ``numaov export wan
--reuse PREVIOUS`` takes each component of ``PREVIOUS`` whose digest equals the one about to
be exported, and whose files still hold what their export wrote, into the new export (hard
links, copies across file systems) instead of exporting it again: a pipeline re-exported with
another LoRA exports its transformer only, not UMT5-XXL and the VAE again. A component that
differs, is missing or whose files changed since is exported as usual, and the report says
which were taken.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from numaov import NumaovError
from numaov.exporter.output_dir import library_versions
from numaov.manifest import MANIFEST_NAME, ExportManifest, ModelDirError, digest_file


class ReuseError(NumaovError):
    """``--reuse`` names something that is not a numaov export."""


def source_digest(source: Path, options: Mapping[str, Any]) -> str:
    """The digest of what a graph is exported from: ``options`` (JSON-able), the versions,
    and every file under ``source`` (its relative name, size and content)."""
    import xxhash

    hasher = xxhash.xxh3_128()
    hasher.update(json.dumps({"options": dict(options), "versions": library_versions()},
                             sort_keys=True).encode())
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest = digest_file(path)
        hasher.update(f"{path.relative_to(source)}\0{digest.size}\0{digest.xxh3_128}\n".encode())
    return hasher.hexdigest()


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

    def export(self, name: str, out_dir: Path, source: Path, options: Mapping[str, Any],
               build: Callable[[], ExportManifest]) -> ExportManifest:
        """The graph ``name`` (its directory relative to the export's root, "" for a bare
        transformer export) in ``out_dir``: ``previous``'s when its ``source_digest`` matches,
        else ``build()``'s (which writes ``out_dir``), with the digest recorded."""
        digest = source_digest(source, options)
        manifest = self._take(name, digest, out_dir)
        if manifest is None:
            manifest = build()
            manifest.source_digest = digest
            manifest.write(out_dir)
        return manifest

    def _take(self, name: str, digest: str, out_dir: Path) -> ExportManifest | None:
        if self.previous is None:
            return None
        directory = self.previous / name
        label = name or "transformer"
        try:
            manifest = ExportManifest.read(directory)
        except ModelDirError:
            return None  # the earlier export has no such graph (or an unreadable one)
        if manifest.source_digest != digest:
            return None
        try:
            for file in manifest.files:
                manifest.verify_file(directory, file)
        except ModelDirError as exc:
            self.report(f"{label}: not reused, {exc}")
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        for file in [*manifest.files, MANIFEST_NAME]:
            _link(directory / file, out_dir / file)
        self.report(f"{label}: reused from {directory} (same checkpoint files and options)")
        return manifest


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)

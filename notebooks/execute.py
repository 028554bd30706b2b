"""Run the notebooks top to bottom and save them with their outputs, in place.

    python notebooks/execute.py [--work DIR] [NOTEBOOK ...]

Every notebook runs in a fresh kernel whose working directory is ``--work`` (default
``out/notebooks``, emptied first so that every export is made again from the committed
checkpoints); the notebooks share it, so the service notebook serves the exports the first two
made. A failing cell stops the run with its traceback and leaves that notebook file as it was.
``make notebooks`` runs this for all of them; ``tests/test_notebooks.py`` runs the same
``execute`` without saving.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 600


def notebooks() -> list[Path]:
    """The notebooks in the order they run (their names start with it)."""
    return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def execute(path: Path, work: Path) -> nbformat.NotebookNode:
    """``path`` run in a new kernel in ``work``; a failing cell raises CellExecutionError."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(work)}}).execute()
    return notebook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("out/notebooks"),
                        help="working directory of the kernels (emptied first)")
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: all)")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    for path in args.paths or notebooks():
        start = time.perf_counter()
        notebook = execute(path.resolve(), args.work.resolve())
        nbformat.write(notebook, path)
        print(f"{path}: ran in {time.perf_counter() - start:.0f} s, saved with its outputs",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

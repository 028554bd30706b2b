"""The notebooks: committed with the outputs of a real run, and run top to bottom in a real
kernel by the same code as ``make notebooks`` (notebooks/execute.py)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import nbformat
import pytest

EXECUTE_PY = Path(__file__).resolve().parent.parent / "notebooks" / "execute.py"
_spec = importlib.util.spec_from_file_location("notebooks_execute", EXECUTE_PY)
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)

NOTEBOOKS = execute.notebooks()
IDS = [p.stem for p in NOTEBOOKS]


def _outputs(notebook: nbformat.NotebookNode) -> list[dict]:
    return [out for cell in notebook.cells for out in cell.get("outputs", [])]


def _images(notebook: nbformat.NotebookNode) -> list[str]:
    """The MIME type of every picture the notebook shows (GIF, PNG)."""
    return [kind for out in _outputs(notebook) for kind in out.get("data", {})
            if kind.startswith("image/")]


def test_the_three_notebooks_are_there() -> None:
    assert IDS == ["1_text_to_video", "2_dp_attention_moe", "3_service"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_with_the_outputs_of_one_whole_run(path: Path) -> None:
    """Every code cell ran, in order, in one kernel, without an error, and the pictures are
    embedded: a reader sees them without running anything."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), (
        f"{path.name} is not saved from one run top to bottom: run `make notebooks`")
    assert not [out for out in _outputs(notebook) if out["output_type"] == "error"]
    assert _images(notebook), f"{path.name} shows no picture"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, demo: dict) -> Path:
    """One working directory for the three, as `make notebooks` has: the service notebook
    serves the exports the first two made. It starts with the demo's digits-wan export,
    which the text-to-video notebook's export takes graph by graph (``reuse``) as a second
    run of the notebook does: the same export from the same checkpoint was made and checked
    by the demo (``make notebooks`` starts empty and exports it again)."""
    work = tmp_path_factory.mktemp("notebooks")
    shutil.copytree(demo["out"] / "wan" / "model", work / "digits-wan")
    return work


@pytest.mark.slow  # exports, rank processes and a server
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs(path: Path, work: Path) -> None:
    # A failing cell (the notebooks assert their parity, tokens and clean shutdown) raises
    # CellExecutionError with the cell's traceback.
    notebook = execute.execute(path, work)
    committed = nbformat.read(path, as_version=4)
    assert _images(notebook) == _images(committed), "the run shows other pictures than the file"

"""examples/notebook.ipynb runs top to bottom in a real Jupyter kernel (nbclient): get_client()
on the embedded default, the cluster widget, a search whose progress renders in Jupyter, and the
cluster gone once the client is closed."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.local

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "notebook.ipynb"


def outputs(cell: nbformat.NotebookNode) -> list[dict]:
    return [dict(o) for o in cell.get("outputs", [])]


def text_of(output: dict) -> str:
    data = output.get("data", {})
    return (
        str(output.get("text", ""))
        + str(data.get("text/plain", ""))
        + str(data.get("text/html", ""))
    )


def test_the_notebook_runs_in_a_kernel_and_leaves_nothing(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells), "store it without outputs"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    runner = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    runner.execute()  # raises CellExecutionError, with the traceback, if a cell fails
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    client, widget, search, best, _close = code
    assert "Client" in text_of(outputs(client)[0])
    widget_out = outputs(widget)[0]
    assert "LocalCluster" in text_of(widget_out)
    assert "text/html" in widget_out["data"]  # the cluster's widget/HTML repr
    # the live progress is a Jupyter widget (rich over ipywidgets), then the best-trials table
    kinds = [set(o.get("data", {})) for o in outputs(search)]
    assert any("application/vnd.jupyter.widget-view+json" in k for k in kinds), kinds
    assert any("best trials" in text_of(o) for o in outputs(search))
    assert not any("warn" in text_of(o).lower() for o in outputs(search)), outputs(search)
    assert text_of(outputs(best)[0]).startswith("best {'x': ")
    deadline = time.monotonic() + 30  # the kernel is shut down: nothing of it may be left
    while left := {p.pid for p in psutil.Process().children(recursive=True)} - before:
        assert time.monotonic() < deadline, f"left running: {left}"
        time.sleep(0.2)

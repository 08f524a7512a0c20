"""Every notebook in notebooks/ executes top to bottom (with its small settings)."""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
# Seconds for a whole notebook, kernel start included, on a busy 2-core CI runner.
NOTEBOOK_TIMEOUT = 180


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=p.name, marks=pytest.mark.timeout(NOTEBOOK_TIMEOUT)) for p in NOTEBOOKS]
)
def test_notebook_executes(path, monkeypatch):
    # The kernel inherits this process's environment: the small-settings switch, and the CPU
    # platform set by conftest.py.
    monkeypatch.setenv("RSTAR2_NOTEBOOK_SMALL", "1")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=NOTEBOOK_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell's traceback, on any error

"""Every notebook in notebooks/ executes top to bottom, as "Run all" does (small settings by default)."""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
# A safety net for a wedged kernel, far above a whole notebook's time (kernel start included) on a
# busy 2-core machine: 02-04 train the tiny run, 1-4 minutes each under load.
NOTEBOOK_TIMEOUT = 900


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=p.name, marks=pytest.mark.timeout(NOTEBOOK_TIMEOUT)) for p in NOTEBOOKS]
)
def test_notebook_executes(path, monkeypatch):
    # The kernel inherits this process's environment: the CPU platform set by conftest.py, and
    # the notebooks' switch off, as on "Run all" (their own asserts check that RL trained).
    monkeypatch.delenv("RSTAR2_NOTEBOOK_FULL", raising=False)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=NOTEBOOK_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell's traceback, on any error

"""Every notebook in notebooks/ runs top to bottom (its own asserts included)."""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra")
nbclient = pytest.importorskip("nbclient", reason="the notebooks extra")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.slow  # A kernel each: 5 to 16 s of CPU.
@pytest.mark.parametrize(
  "path",
  NOTEBOOKS,
  ids=lambda p: p.stem,
)
def test_notebook_runs(path):
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    notebook,
    timeout=120,
    kernel_name="python3",
    resources={"metadata": {"path": str(path.parent)}},
  )
  client.execute()
  errors = [
    output
    for cell in notebook.cells
    if cell.cell_type == "code"
    for output in cell.get("outputs", [])
    if output.get("output_type") == "error"
  ]
  assert not errors

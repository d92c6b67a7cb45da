"""The docs site: its pages' code prints what they show, and it builds cleanly."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import jax
import pytest
from markdown_examples import run_examples

import optax_accum

DOCS = pathlib.Path(__file__).parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))


#: Pages whose blocks take 10 s of CPU or more: run first (see tests/conftest.py).
SLOW_PAGES = {"recipes", "schedules"}


def _marked(page):
  return pytest.param(page, marks=[pytest.mark.slow] if page.stem in SLOW_PAGES else [])


@pytest.mark.parametrize("page", [_marked(p) for p in PAGES], ids=lambda p: p.stem)
def test_python_blocks_print_what_the_page_shows(page):
  """Each page is its own session: a reader can run it from the top. The
  pages show what a CPU prints (8 simulated devices, XLA:CPU's memory)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the pages show what a CPU prints")
  run_examples(page)


def test_every_row_of_what_happens_when_names_a_test_that_exists():
  page = (DOCS / "multi_steps.md").read_text()
  section = page.split("## What happens when...", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
  assert len(rows) >= 20
  for row in rows:
    match = re.search(r"`(test_\w+\.py)::(\w+)`", row)
    assert match, f"no test named in row: {row}"
    source = (DOCS.parent / "tests" / match[1]).read_text()
    assert re.search(rf"^\s*(def|class) {match[2]}\b", source, re.MULTILINE), row


def test_the_api_reference_documents_every_public_name():
  api = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^\.\. auto\w+:: optax_accum\.(\w+)$", api, re.M))
  assert documented == set(optax_accum.__all__) - {"__version__"}


@pytest.mark.slow
def test_every_page_and_notebook_is_in_the_site(tmp_path):
  """``make docs``: Sphinx with warnings as errors, so a broken link, a page
  left out of the toctree or a docstring that is not valid reST fails here.
  The notebooks are rendered from their committed outputs (not executed)."""
  if importlib.util.find_spec("sphinx") is None or not importlib.util.find_spec(
    "sphinx.__main__"
  ):
    pytest.skip("the docs extra (pip install -e '.[docs]')")
  out = tmp_path / "html"
  sphinx = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
  build = subprocess.run(
    [*sphinx, "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert build.returncode == 0, build.stderr
  assert not build.stderr.strip(), build.stderr
  for page in PAGES:
    assert (out / f"{page.stem}.html").is_file(), page.name
  notebooks = sorted((DOCS.parent / "notebooks").glob("*.ipynb"))
  assert notebooks
  for notebook in notebooks:
    html = (out / "notebooks" / f"{notebook.stem}.html").read_text()
    assert 'class="cell_output' in html, notebook.name  # Committed outputs shown.
  assert "optax_accum.make_train_step" in (out / "api.html").read_text()

"""The README's code runs and prints what the README shows; CI runs its test command."""

import pathlib
import re

import pytest
from markdown_examples import python_examples, run_examples

#: The README shows what a reader's run prints: compiled as the reader's are.
pytestmark = pytest.mark.full_optimization

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"


def test_python_blocks_print_what_the_readme_shows():
  assert len(python_examples(README.read_text())) >= 1
  run_examples(README)


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"^(make \w+)\s+# sets up", README.read_text(), re.MULTILINE)
  assert commands == ["make demo", "make test"]
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert "make test" in ci


def test_readme_links_to_docs_pages_that_exist():
  links = re.findall(r"\]\((docs/[\w./-]+?)(?:#[\w-]+)?\)", README.read_text())
  assert len(links) >= 10
  for link in links:
    assert (ROOT / link).is_file(), link

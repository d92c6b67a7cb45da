"""Runs a markdown page's Python blocks and checks the output blocks after them."""

import contextlib
import io
import pathlib
import re

# A Python block, optionally followed by the text block of what it prints.
_EXAMPLE = re.compile(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```)?", re.DOTALL)


def python_examples(text: str) -> list[tuple[str, str]]:
  """``(code, shown)`` pairs in page order; ``shown`` is "" when not shown."""
  return _EXAMPLE.findall(text)


def run_examples(path: pathlib.Path) -> int:
  """Runs the page's blocks in one namespace, like a reader's session, and
  checks each printed output; returns how many blocks ran."""
  namespace: dict = {}
  examples = python_examples(path.read_text())
  for code, shown in examples:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(code, str(path), "exec"), namespace)
    if shown:
      assert out.getvalue().strip() == shown.strip(), f"{path.name}:\n{code}"
  return len(examples)


def documented_function(path: pathlib.Path, name: str):
  """The function ``name`` as the page's one block that defines it does."""
  blocks = [code for code, _ in python_examples(path.read_text())]
  (code,) = [code for code in blocks if f"def {name}(" in code]
  namespace: dict = {}
  exec(compile(code, str(path), "exec"), namespace)
  return namespace[name]

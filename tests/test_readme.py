"""The README's code runs and prints what the README says; CI runs its test command."""

import contextlib
import io
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
# A Python block, optionally followed by the text block of what it prints.
EXAMPLES = re.findall(
  r"```python\n(.*?)```\n(?:\n```text\n(.*?)```)?", README, flags=re.DOTALL
)


def test_python_blocks_print_what_the_readme_shows():
  assert len(EXAMPLES) >= 2
  namespace: dict = {}  # Like a reader's session: later blocks reuse names.
  for code, shown in EXAMPLES:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(code, "README.md", "exec"), namespace)
    if shown:
      assert out.getvalue().strip() == shown.strip(), code


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"^(make \w+)\s+# sets up", README, flags=re.MULTILINE)
  assert commands == ["make demo", "make test"]
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert "make test" in ci


def test_every_row_of_what_happens_when_names_a_test_that_exists():
  section = README.split("### What happens when...", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
  assert len(rows) >= 20
  for row in rows:
    match = re.search(r"`(test_\w+\.py)::(\w+)`", row)
    assert match, f"no test named in row: {row}"
    source = (ROOT / "tests" / match[1]).read_text()
    assert re.search(rf"^\s*(def|class) {match[2]}\b", source, re.MULTILINE), row

"""The README's code runs, and CI runs the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_python_blocks_run(capsys):
  blocks = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
  assert blocks, "the README has no Python example"
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})
  assert capsys.readouterr().out.strip().endswith("2")  # The quickstart's claim.


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"^(make \w+)\s+# sets up", README, flags=re.MULTILINE)
  assert commands == ["make demo", "make test"]
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert "make test" in ci

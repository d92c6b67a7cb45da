"""The layering of docs/development.md holds: the window arithmetic stands alone."""

import ast
import pathlib

import optax_accum

PACKAGE = pathlib.Path(optax_accum.__file__).parent


def _imports(module: str) -> set[str]:
  tree = ast.parse((PACKAGE / f"{module}.py").read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      names |= {f"{base}.{alias.name}" if base else alias.name for alias in node.names}
  return names


def test_window_arithmetic_imports_neither_optax_nor_collectives():
  imports = _imports("_window")
  assert imports, "the parse found no imports at all"
  assert not [name for name in imports if name.split(".")[0] == "optax"], imports
  inside = {name for name in imports if name.startswith("optax_accum")}
  assert inside == {"optax_accum._checks"}, inside
  # _checks itself does no collectives and needs no optax.
  assert not [n for n in _imports("_checks") if n.split(".")[0] in ("optax",)]
  assert "psum" not in (PACKAGE / "_window.py").read_text()


def test_multi_steps_takes_no_train_step_only_parameters():
  """The adapter's update has optax's signature plus weight, end_window, loss."""
  import inspect

  params = inspect.signature(optax_accum.MultiSteps.update).parameters
  assert list(params) == [
    "self",
    "updates",
    "state",
    "params",
    "weight",
    "end_window",
    "loss",
    "extra_args",
  ]
  for gone in ("add", "close", "window_ends", "replica_sum", "with_axis_name"):
    assert not hasattr(optax_accum.MultiSteps, gone), gone

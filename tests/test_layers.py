"""The layering of docs/development.md holds: the window arithmetic stands alone,
the core imports no wing, and each wing uses only the core and the others'
interfaces."""

import ast
import importlib
import pathlib

import optax_accum

PACKAGE = pathlib.Path(optax_accum.__file__).parent


def _imports(module: str) -> set[str]:
  tree = ast.parse((PACKAGE / f"{module}.py").read_text())
  return _names(tree)


def _names(tree: ast.AST) -> set[str]:
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      names |= {f"{base}.{alias.name}" if base else alias.name for alias in node.names}
  return names


def test_window_arithmetic_imports_neither_optax_nor_collectives():
  imports = _imports("_core/_window")
  assert imports, "the parse found no imports at all"
  assert not [name for name in imports if name.split(".")[0] == "optax"], imports
  inside = {name for name in imports if name.startswith("optax_accum")}
  want = {"optax_accum._core._backend", "optax_accum._core._checks"}
  assert inside == want | {"optax_accum._core._noise"}, inside
  # _checks and _noise themselves do no collectives and need no optax.
  for module in ("_core/_checks", "_core/_noise"):
    assert not [n for n in _imports(module) if n.split(".")[0] in ("optax",)]
    assert not [n for n in _imports(module) if n.startswith("optax_accum")]
  for module in ("_window", "_noise"):
    assert "psum" not in (PACKAGE / "_core" / f"{module}.py").read_text()


WINGS = ("_layouts", "_step", "_progress", "_frameworks", "_planning", "_audit")


def _wing_imports() -> dict[str, set[str]]:
  """Every ``optax_accum`` name each subpackage imports, by subpackage."""
  found: dict[str, set[str]] = {}
  for path in sorted(PACKAGE.glob("_*/*.py")):
    wing = path.parent.name
    names = _names(ast.parse(path.read_text()))
    found.setdefault(wing, set()).update(
      n for n in names if n.startswith("optax_accum")
    )
  return found


def test_every_module_lives_in_a_wing_or_is_public():
  loose = {p.name for p in PACKAGE.glob("*.py")}
  assert loose == {"__init__.py", "demo.py", "flax.py"}, loose
  assert {p.name for p in PACKAGE.glob("_*/") if p.is_dir()} - {"__pycache__"} == {
    "_core",
    *WINGS,
  }


def test_the_core_imports_no_wing():
  imports = _wing_imports()["_core"]
  assert imports, "the parse found no imports at all"
  outside = {n for n in imports if not n.startswith("optax_accum._core")}
  assert not outside, outside


def test_each_wing_uses_only_the_core_and_the_other_wings_interfaces():
  """``from optax_accum._step import make_train_step`` is fine from the planner;
  ``from optax_accum._step._programs import ...`` is not."""
  for wing, imports in _wing_imports().items():
    if wing == "_core":
      continue
    for name in imports:
      parts = name.split(".")
      other = parts[1]
      if other in ("_core", wing):
        continue
      assert other in WINGS, (wing, name)
      interface = importlib.import_module(f"optax_accum.{other}").__all__
      assert len(parts) == 3 and parts[2] in interface, (wing, name)


def test_the_train_step_imports_no_wing_above_it():
  imports = _wing_imports()["_step"]
  assert {n.split(".")[1] for n in imports} <= {"_core", "_layouts", "_step"}, imports


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

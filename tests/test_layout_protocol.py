"""A layout is one factory: ``tests/flat_layout.py`` adds one (the sums stored
as a flat tuple) without editing the library, and it runs bit for bit as one
sum on every path; nothing outside the layouts layer asks a layout's type."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flat_layout import Flat, flat

import optax_accum
from benchmarks import accumulation
from optax_accum._core import _backend
from optax_accum._layouts import ONE_SUM
from optax_accum._step._programs import TwoPrograms, programs

K = 3
PACKAGE = pathlib.Path(optax_accum.__file__).parent


@pytest.fixture(scope="module")
def run():
  """A 6-leaf model, its optimizer, both modes' steps and 2 windows of batches."""
  model = accumulation.many_leaves(6, 8, 2)
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), K)
  steps = {
    "stream": optax_accum.make_train_step(model["loss_fn"], opt),
    "scan": optax_accum.make_train_step(model["loss_fn"], opt, mode="scan"),
  }
  batches = [model["batch"](model["rows"]) for _ in range(2 * K)]
  return model["params"], opt, steps, batches


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _same(a, b):
  """Bit for bit, the accumulator compared as one sum."""
  a, b = (
    t._replace(acc_grads=optax_accum._layouts.to_sum(t.acc_grads)) for t in (a, b)
  )
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  same = [np.array_equal(x, y) for x, y in pairs]
  return bool(same) and all(same)


def _stream(step, params, state, batches, *, check=None):
  for batch in batches:
    params, state, _ = step(params, state, batch)
    if check is not None:
      check(state)
  return params, state


def _is_flat(state):
  assert isinstance(state.acc_grads, Flat), type(state.acc_grads)


def _windows(batches):
  return [jax.tree.map(lambda *x: np.stack(x), *batches[i : i + K]) for i in (0, K)]


def _flat_state(state):
  return _copy(state._replace(acc_grads=flat(state.acc_grads)))


def _same_run(want, got):
  params = jax.tree.map(np.array_equal, want[0], got[0])
  return _same(want[1], got[1]) and jax.tree.all(params)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_a_layout_in_one_file_streams_and_scans_as_one_sum(run, mode):
  params, opt, steps, batches = run
  start = opt.init(params)
  batches = batches if mode == "stream" else _windows(batches)
  step = steps[mode]
  want = _stream(step, _copy(params), _copy(start), batches)
  got = _stream(step, _copy(params), _flat_state(start), batches, check=_is_flat)
  assert _same_run(want, got)
  moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), got[0], params)
  assert all(jax.tree.leaves(moved))  # Two windows' updates applied.


@pytest.mark.parametrize("path", ["jit", "lax.scan"])
def test_a_layout_in_one_file_runs_in_the_users_jit_and_scan(run, path):
  params, opt, steps, batches = run
  step = steps["stream"]
  start = opt.init(params)
  want = _stream(step, _copy(params), _copy(start), batches)
  if path == "jit":
    jitted = jax.jit(lambda p, s, b: step(p, s, b)[:2])
    got = _copy(params), _flat_state(start)
    for batch in batches:
      got = jitted(*got, batch)
      _is_flat(got[1])
  else:
    stacked = jax.tree.map(lambda *x: np.stack(x), *batches)

    def body(carry, batch):
      return step(*carry, batch)[:2], None

    got, _ = jax.jit(lambda c, b: jax.lax.scan(body, c, b))(
      (_copy(params), _flat_state(start)), stacked
    )
    _is_flat(got[1])
  assert _same_run(want, got)


def test_a_layout_in_one_file_relayouts_and_multi_steps_refuses_it(run):
  params, opt, _, _ = run
  start = opt.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, one = opt.update(grads, start, params, weight=2.0)
  flat_state = optax_accum.relayout(one, _flat_state(start))
  _is_flat(flat_state)
  assert _same(one, flat_state)
  back = optax_accum.relayout(flat_state, start)  # from_sum(to_sum(acc)), exact.
  assert jax.tree.structure(back.acc_grads) == jax.tree.structure(params)
  assert _same(one, back)
  with pytest.raises(ValueError, match=r"flat tuple.*optax_accum\.relayout"):
    opt.update(grads, flat_state, params, weight=2.0)
  want = opt.update(grads, one, params, weight=3.0)
  got = opt.update(grads, back, params, weight=3.0)
  assert _same(want[1], got[1])


def test_a_layout_in_one_file_restores_mid_window_with_orbax(run, tmp_path):
  params, opt, steps, batches = run
  step = steps["stream"]
  start = opt.init(params)
  want = _stream(step, _copy(params), _copy(start), batches)
  mid = _stream(step, _copy(params), _flat_state(start), batches[:2])
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "mid", {"params": mid[0], "opt_state": mid[1]})
  ckpt.wait_until_finished()
  saved = ckpt.metadata(tmp_path / "mid").item_metadata["opt_state"]
  target = optax_accum.resume_target(_flat_state(opt.init(params)), saved)
  _is_flat(target)
  restored = ckpt.restore(tmp_path / "mid", {"params": params, "opt_state": target})
  got = _stream(step, restored["params"], restored["opt_state"], batches[2:])
  _is_flat(got[1])
  assert _same_run(want, got)


@pytest.mark.parametrize("two", [True, False])
def test_the_builder_asks_the_backend_whether_a_window_ends_in_two_programs(two):
  model = accumulation.many_leaves(4, 8, 2)
  opt = optax_accum.MultiSteps(optax.sgd(0.1), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  with _backend.overridden(jax.default_backend(), two_programs=two):
    pair = programs(ONE_SUM, step._bodies, scan=False, donate=False)
    scan = programs(ONE_SUM, step._bodies, scan=True, donate=False)
  assert isinstance(pair.update, TwoPrograms) == two
  assert not isinstance(scan.update, TwoPrograms)  # A scan window is one program.


def _streamed(model, two_programs):
  """Ten micro-batches (the second window cut short) with a window ending
  in two programs or one: params, state, metrics."""
  with _backend.overridden(jax.default_backend(), two_programs=two_programs):
    opt = optax_accum.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), K)
    step = optax_accum.make_train_step(model["loss_fn"], opt)
    params = jax.tree.map(jnp.copy, model["params"])
    state, metrics = step.init(params), []
    for call in range(10):
      rows = model["batch"](model["rows"])
      params, state, out = step(params, state, rows, end_window=call == K + 1)
      metrics.append(out)
  return params, state, metrics


@pytest.mark.full_optimization  # Bit for bit as a default build compiles them.
def test_a_window_ends_bit_identically_in_two_programs_or_one():
  """Where the backend seam says one program (GPUs), a window's last call
  runs the merged update program: params, state and every metric bit for
  bit as the two programs give."""
  one = _streamed(accumulation.MODELS["lm-1x8-b2"](), two_programs=False)
  two = _streamed(accumulation.MODELS["lm-1x8-b2"](), two_programs=True)
  assert jax.tree.structure(one) == jax.tree.structure(two)
  pairs = zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True)
  assert all(np.array_equal(a, b) for a, b in pairs)


def _layout_names():
  """Every class the layouts layer defines (stored nodes and layouts)."""
  names = set()
  for path in (PACKAGE / "_layouts").glob("*.py"):
    tree = ast.parse(path.read_text())
    names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
  return names


def _named(node):
  """The names an ``isinstance`` type argument spells (tuples, ``|``)."""
  if isinstance(node, ast.Name):
    return {node.id}
  if isinstance(node, ast.Attribute):
    return {node.attr}
  if isinstance(node, ast.Tuple):
    return set().union(*map(_named, node.elts))
  if isinstance(node, ast.BinOp):
    return _named(node.left) | _named(node.right)
  return set()


def test_no_layout_dispatch_outside_the_layouts_layer():
  """No ``isinstance`` on a layout class or node, and no stored node's field
  (by name or attribute), anywhere in the package but ``optax_accum/_layouts/``."""
  layout_names = _layout_names()
  assert {"PerReplica", "Packed", "Layout"} <= layout_names
  fields = {"sums", "groups", "rest"}
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if "_layouts" in path.parts:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
        "isinstance",
        "issubclass",
      ):
        hit = _named(node.args[1]) & layout_names
        if hit:
          found.append(f"{path.name}:{node.lineno} isinstance {sorted(hit)}")
      if isinstance(node, ast.Constant) and node.value in fields:
        found.append(f"{path.name}:{node.lineno} field name {node.value!r}")
      if isinstance(node, ast.Attribute) and node.attr in fields | {"packing"}:
        found.append(f"{path.name}:{node.lineno} field .{node.attr}")
  assert not found, found


def test_a_layout_is_a_value_of_four_fields_that_no_class_extends():
  """A layout is a ``Layout`` value built by a factory (``flat_layout`` here):
  four fields, no registry, and no class anywhere subclasses it."""
  from flat_layout import FLAT, flat_layout

  from optax_accum._layouts import Layout

  assert Layout._fields == ("reduction", "store", "wrap", "sharded")
  assert isinstance(FLAT, Layout) and flat_layout() != FLAT  # A new value each call.
  paths = [
    *sorted(PACKAGE.rglob("*.py")),
    pathlib.Path(__file__).with_name("flat_layout.py"),
  ]
  bases = [
    (path.name, node.name)
    for path in paths
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.ClassDef)
    and "Layout" in set().union(*map(_named, node.bases))
  ]
  assert not bases, bases
  assert not hasattr(optax_accum._layouts, "register")

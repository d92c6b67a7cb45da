"""Compile cost grows linearly in the leaves (issue 48): deterministic figures.

XLA copies a cheap scalar chain into every consumer's kernel. A whole-tree
scalar (the window's squared norm, its finite flag) read by every leaf's
select made each leaf's kernel carry an add per leaf: the compiled module of
``MultiSteps.update`` in the user's ``jit`` grew with the square of the
leaves (7,801 instructions at 44 leaves, 27,161 at 88). The compiled module's
instruction count is deterministic for one jax version; the CPU-seconds are
in ``benchmarks/compile.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from benchmarks.accumulation import many_leaves, optax_in_jit
from benchmarks.compile import accum_update_in_jit, instructions
from optax_accum._core import _backend

K = 4
SMALL, LARGE = 12, 48  # Leaves: four times as many.


def _model(leaves):
  model = many_leaves(leaves, 8, 2)
  return model["params"], model["loss_fn"], model["batch"](2)


def _update_in_jit(leaves):
  """``MultiSteps.update`` in the user's ``jit``, as the README writes it."""
  params, loss_fn, batch = _model(leaves)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  state = opt.init(params)
  micro_step = accum_update_in_jit(loss_fn, opt)
  return jax.jit(micro_step).lower(params, state, batch).compile()


def _step_in_jit(leaves):
  """The train step traced in the user's ``jit``."""
  params, loss_fn, batch = _model(leaves)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  step = optax_accum.make_train_step(loss_fn, opt)
  state = step.init(params)
  run = jax.jit(lambda p, s, b: step(p, s, b)[:2])
  return run.lower(params, state, batch).compile()


def _optax_in_jit(leaves):
  params, loss_fn, batch = _model(leaves)
  ms = optax.MultiSteps(optax.adamw(1e-3), K)
  step = jax.jit(optax_in_jit(loss_fn, ms))
  return step.lower(params, ms.init(params), batch).compile()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's module")
@pytest.mark.parametrize("path", [_update_in_jit, _step_in_jit], ids=["update", "step"])
def test_the_compiled_module_grows_linearly_in_the_leaves(path):
  """Four times the leaves, at most four times the instructions (a fixed
  part makes it fewer), and no more than ``optax.MultiSteps``' module at
  either size."""
  small, large = (instructions(path(n)) for n in (SMALL, LARGE))
  assert large <= 4 * small, (small, large)
  assert large <= instructions(_optax_in_jit(LARGE)), large


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's module")
def test_the_gpu_form_grows_linearly_in_the_leaves(monkeypatch):
  """The select form the GPU gets (``lax.platform_dependent``'s default
  branch, compiled here by XLA:CPU): every leaf's select reads the window's
  flag, not the norm's chain over every leaf (the old form took 37 s of
  CPU to compile at 88 leaves)."""
  monkeypatch.setattr(
    jax.lax, "platform_dependent", _default_branch(jax.lax.platform_dependent)
  )
  small, large = (instructions(_update_in_jit(n)) for n in (SMALL, LARGE))
  assert large <= 4 * small, (small, large)


def _default_branch(platform_dependent):
  def default(*args, default, **branches):
    return platform_dependent(*args, cpu=default, default=default)

  return default


def test_instructions_counts_the_values_a_module_defines():
  compiled = jax.jit(lambda x: jnp.sin(x) + 1).lower(jnp.ones(3)).compile()
  assert 2 <= instructions(compiled) <= 10


def _reductions(compiled) -> int:
  return compiled.as_text().count(" reduce(")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's module")
def test_the_norm_reduces_small_leaves_a_group_at_a_time(monkeypatch):
  """XLA:CPU compiles a kernel per reduction: the window's norm sums the
  squares of ``SMALL`` small leaves in one reduction per group
  (``_backend.norm_groups``), against one per leaf unless the backend groups;
  the norm is the same but for the order of its adds."""
  params, loss_fn, batch = _model(SMALL)
  groups = _backend.norm_groups(params)
  assert 1 <= len(groups) < SMALL // 4 and sum(map(len, groups)) == SMALL
  grouped = _reductions(_update_in_jit(SMALL))
  norms = [_window_norm(params, loss_fn, batch)]
  cpu = _backend.for_platform("cpu")
  monkeypatch.setitem(_backend._BACKENDS, "cpu", cpu._replace(groups_norm=False))
  assert _backend.norm_groups(params) == ()
  per_leaf = _reductions(_update_in_jit(SMALL))
  norms.append(_window_norm(params, loss_fn, batch))
  assert per_leaf - grouped == SMALL - len(groups), (per_leaf, grouped)
  np.testing.assert_allclose(*norms, rtol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's module")
def test_a_norm_group_holds_at_most_the_backend_s_leaves():
  """A variadic reduction compiles in time growing faster than its operands
  (at 176 leaves of 8 x 8, groups of 128 and 48 compile slower than groups of 16):
  leaves of one shape in consecutive groups of at most ``max_group_leaves``,
  within the element bound."""
  cap = _backend.for_platform("cpu").max_group_leaves
  like = [jnp.ones((8, 8))] * (2 * cap + 3) + [jnp.ones(8)] * 2
  groups = _backend.norm_groups(like)
  assert [len(g) for g in groups] == [cap, cap, 3, 2]
  assert [i for g in groups for i in g] == list(range(len(like)))


def _window_norm(params, loss_fn, batch):
  """The train step's ``grad_norm`` after a window of ``K`` micro-batches."""
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  step = optax_accum.make_train_step(loss_fn, opt)
  params = jax.tree.map(jnp.copy, params)  # The step donates them.
  state = step.init(params)
  for _ in range(K):
    params, state, metrics = step(params, state, batch)
  assert metrics["updated"]
  return float(metrics["grad_norm"])

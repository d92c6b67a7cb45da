"""The Layout protocol (issue 48, item 3): a layout is one object, and the one
builder makes its programs.

A layout new to the step, written here in a few lines (its sums stored as a
flat tuple of leaves), runs the step's bodies bit for bit as the one-sum
layout does; the builder asks each layout, never its type, whether a streamed
window ends in two programs.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from benchmarks import accumulation
from optax_accum._core import _backend
from optax_accum._step import _one_sum
from optax_accum._step._programs import counters, joined
from optax_accum._step._signature import Inputs, Split

K = 3


@dataclasses.dataclass(frozen=True)
class FlatLayout(_one_sum.Layout):
  """The sums stored as a flat tuple of leaves between calls."""

  treedef: Any
  converts: ClassVar[bool] = True

  def stored(self, state, params=None, terms=None):
    return state._replace(acc_grads=tuple(jax.tree.leaves(state.acc_grads)))

  def inside(self, acc):
    return jax.tree.unflatten(self.treedef, acc)

  def outside(self, acc):
    return tuple(jax.tree.leaves(acc))


def _window(step, layout, state, params, batches):
  """``K`` micro-batches through ``layout``'s programs: the accumulate
  program, then the update program on the last."""
  pair = _one_sum.programs(layout, step._bodies, scan=False, donate=False)
  for i, batch in enumerate(batches):
    inputs = Inputs(params, None, state.acc_grads, counters(state), batch, None)
    if i < len(batches) - 1:
      out = pair.accumulate(inputs)
      state = joined(out.counters, state.inner_opt_state, out.acc)
    else:
      inputs = inputs._replace(inner=state.inner_opt_state, end_window=False)
      out = pair.update(inputs)
      params, state = out.params, joined(out.counters, out.inner, out.acc)
  return params, state, pair


def test_a_new_layout_runs_the_bodies_bit_for_bit_as_one_sum():
  model = accumulation.many_leaves(6, 8, 2)
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  params = model["params"]
  batches = [model["batch"](model["rows"]) for _ in range(K)]
  start = opt.init(params)
  flat = FlatLayout(jax.tree.structure(start.acc_grads))
  want, _, _ = _window(step, _one_sum.ONE_SUM, start, params, batches)
  got, state, pair = _window(step, flat, flat.stored(start), params, batches)
  assert isinstance(state.acc_grads, tuple)  # Stored as the layout says.
  assert not isinstance(pair.update, Split)  # The default: one program.
  pairs = zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
  same = [np.array_equal(a, b) for a, b in pairs]
  assert same and all(same)
  assert float(optax.tree.norm(jax.tree.map(jnp.subtract, got, params))) > 0


@pytest.mark.parametrize("two", [True, False])
def test_the_builder_asks_the_layout_whether_a_window_ends_in_two_programs(two):
  model = accumulation.many_leaves(4, 8, 2)
  opt = optax_accum.MultiSteps(optax.sgd(0.1), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  with _backend.overridden(jax.default_backend(), two_programs=two):
    pair = _one_sum.programs(_one_sum.ONE_SUM, step._bodies, scan=False, donate=False)
    scan = _one_sum.programs(_one_sum.ONE_SUM, step._bodies, scan=True, donate=False)
  assert isinstance(pair.update, Split) == two
  assert not isinstance(scan.update, Split)  # A scan window is one program.


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


def test_a_window_ends_bit_identically_in_two_programs_or_one():
  """Where the backend seam says one program (GPUs), a window's last call
  runs the merged update program: params, state and every metric bit for
  bit as the two programs give."""
  one = _streamed(accumulation.MODELS["lm-1x8-b2"](), two_programs=False)
  two = _streamed(accumulation.MODELS["lm-1x8-b2"](), two_programs=True)
  assert jax.tree.structure(one) == jax.tree.structure(two)
  pairs = zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True)
  assert all(np.array_equal(a, b) for a, b in pairs)

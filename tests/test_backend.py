"""The backend seam (``optax_accum._core._backend``): programs lowered for a
GPU hold no control flow that XLA:GPU decides on the host, and the GPU form
(the optimizer always run, a select keeping the old values) gives the whole
batch's result; CPU keeps its conds.

No GPU is needed: ``Traced.lower(lowering_platforms=("cuda",))`` lowers on
any machine, and the GPU form runs on CPU with ``lax.platform_dependent``
made to pick its default branch.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum
from benchmarks.hlo import data_dependent_control_flow
from optax_accum._core import _backend

K = 2
BATCHES = [toy_lm.make_batch(seed=20 + window, batch=8) for window in range(2)]
INNER = optax.adam(0.05)


def _user_step(opt):
  """``MultiSteps.update`` in the user's own ``jit``, as optax users write it."""

  def step(params, state, batch):
    grads, tokens = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
    updates, state = opt.update(grads, state, params, weight=tokens)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def _paths():
  """Each path a micro-step can take inside a user's ``jit``: its traced
  program and arguments (the first micro-batch of a window)."""
  opt = optax_accum.MultiSteps(INNER, K)
  params = toy_lm.init_params()
  micro_batch = toy_lm.split(BATCHES[0], K)[0]
  stream = optax_accum.make_train_step(toy_lm.mean_loss, opt)
  scan = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode="scan")
  window = optax_accum.split_micro_batches(BATCHES[0], K)
  return {
    "MultiSteps.update": (_user_step(opt), (params, opt.init(params), micro_batch)),
    "stream step": (jax.jit(stream), (params, opt.init(params), micro_batch)),
    "scan step": (jax.jit(scan), (params, opt.init(params), window)),
  }


@pytest.mark.parametrize("path", ["MultiSteps.update", "stream step", "scan step"])
def test_lowered_for_a_gpu_no_control_flow_waits_for_the_host(path):
  fn, args = _paths()[path]
  traced = fn.trace(*args)
  gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert data_dependent_control_flow(gpu) == []
  # The reader finds what it must: the CPU form keeps a cond that runs the
  # optimizer once or never.
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert data_dependent_control_flow(cpu)


def test_the_reader_tells_counted_loops_from_data_dependent_ones():
  def scanned(x):
    return jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0]

  def looped(x):
    return jax.lax.while_loop(lambda c: c.sum() < 10, lambda c: c * 2, x)

  def branched(x):
    return jax.lax.cond(x.sum() > 0, lambda: x, lambda: -x)

  x = jnp.ones(2)
  found = {
    f.__name__: data_dependent_control_flow(jax.jit(f).lower(x).as_text())
    for f in (scanned, looped, branched)
  }
  assert found["scanned"] == []
  assert len(found["looped"]) == 1 and "while" in found["looped"][0]
  assert len(found["branched"]) == 1 and "case" in found["branched"][0]


@pytest.fixture
def gpu_form(monkeypatch):
  """``lax.platform_dependent`` picks its default branch: the GPU form."""

  def default_branch(*args, default, **_):
    return default(*args)

  monkeypatch.setattr(jax.lax, "platform_dependent", default_branch)


def _whole_batch_params():
  params, _, _ = toy_lm.whole_batch_run(toy_lm.init_params(), BATCHES, INNER)
  return params


def _streamed(step, params, state):
  for batch in BATCHES:
    for micro_batch in toy_lm.split(batch, K):
      params, state, *_ = step(params, state, micro_batch)
  return params, state


def test_gpu_form_of_multi_steps_update_matches_the_whole_batch(gpu_form):
  opt = optax_accum.MultiSteps(INNER, K)
  step = _user_step(opt)
  params = toy_lm.init_params()
  lowered = step.trace(params, opt.init(params), BATCHES[0]).lower().as_text()
  assert data_dependent_control_flow(lowered) == []  # The GPU form, on CPU.
  params, state = _streamed(lambda p, s, b: (*step(p, s, b),), params, opt.init(params))
  assert int(state.gradient_step) == 2
  chex.assert_trees_all_close(params, _whole_batch_params(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_gpu_form_of_the_train_step_matches_the_whole_batch(gpu_form, mode):
  opt = optax_accum.MultiSteps(INNER, K)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode=mode)
  params, state = toy_lm.init_params(), opt.init(toy_lm.init_params())
  if mode == "stream":
    params, state = _streamed(step, params, state)
  else:
    for batch in BATCHES:
      params, state, _ = step(params, state, optax_accum.split_micro_batches(batch, K))
  assert int(state.gradient_step) == 2
  chex.assert_trees_all_close(params, _whole_batch_params(), rtol=1e-5, atol=1e-6)


def test_gpu_form_skips_a_non_finite_window_without_a_nan(gpu_form):
  def loss_fn(params, batch):
    loss, tokens = toy_lm.mean_loss(params, batch)
    return loss + batch["poison"] * sum(
      jnp.sum(p) for p in jax.tree.leaves(params)
    ), tokens

  opt = optax_accum.MultiSteps(INNER, K)
  step = optax_accum.make_train_step(loss_fn, opt)
  params, out = toy_lm.init_params(), toy_lm.init_params()  # `out` is donated.
  state = opt.init(params)
  micro_batches = toy_lm.split(BATCHES[0], K)
  for poison, micro_batch in zip([0.0, np.inf], micro_batches, strict=True):
    out, state, metrics = step(out, state, {**micro_batch, "poison": poison})
  assert int(state.skipped_windows) == 1 and not bool(metrics["updated"])
  chex.assert_trees_all_equal(out, params)  # Unchanged, and no NaN.
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.inner_opt_state))


@pytest.mark.parametrize("dtype", [jnp.float16, None])
def test_a_narrow_accumulator_is_rounded_where_xla_gpu_cannot_skip_it(dtype):
  """XLA:GPU (excess precision allowed, its default) removes a float16 round
  trip, so a sum that overflows float16 would stay finite where the window
  ends in the same program. Each narrowed sum passes a barrier that the
  removal cannot see through; a float32 accumulator gets none, and XLA:CPU's
  compiled program none either."""
  opt = optax_accum.MultiSteps(INNER, K, accumulator_dtype=dtype)
  params = toy_lm.init_params()
  micro_batch = toy_lm.split(BATCHES[0], K)[0]
  traced = _user_step(opt).trace(params, opt.init(params), micro_batch)
  gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
  barriers = [line for line in gpu.splitlines() if "optimization_barrier" in line]
  if dtype is None:
    assert barriers == []
  else:
    assert len(barriers) == len(jax.tree.leaves(params))
    assert all("xf16>" in line for line in barriers)
  cpu = traced.lower(lowering_platforms=("cpu",)).compile().as_text()
  assert "opt-barrier" not in cpu


def test_a_window_end_traces_the_optimizer_once():
  """The optimizer's trace is most of a program's: ``_backend.once_if`` traces
  it once for its types, the ``cond`` (CPU, TPU) and the select (GPUs) together
  (``lax.platform_dependent`` traces each distinct branch: 3 traces before)."""
  traces = []

  def fn(x):
    traces.append(1)
    return x + 1

  x = jnp.zeros(())
  jax.jit(lambda p: _backend.once_if(p, fn, x)).trace(jnp.array(True))
  assert len(traces) == 1

"""The oracle: an accumulated window must match training on the whole batch.

Variable-length, padded sequences make the micro-batches hold very different
numbers of tokens, which is where the mean of per-micro-batch means (F1) and
per-micro-batch token counts (F2) go wrong.
"""

import functools
import itertools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum

LOSSES = {"mean": toy_lm.mean_loss, "sum": toy_lm.sum_loss}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _accumulate(opt, loss_fn, params, state, micro_batch):
  grads, weight = jax.grad(loss_fn, has_aux=True)(params, micro_batch)
  return opt.update(grads, state, params, weight=weight)


@functools.partial(jax.jit, static_argnums=(0,))
def _accumulate_optax(opt, params, state, micro_batch):
  grads, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params, micro_batch)
  return opt.update(grads, state, params)


def _window_gradient(opt, loss_fn, params, micro_batches):
  state = opt.init(params)
  for micro_batch in micro_batches:
    emitted, state = _accumulate(opt, loss_fn, params, state, micro_batch)
  np.testing.assert_equal(np.asarray(state.gradient_step), 1)
  return emitted


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_window_gradient_equals_whole_batch_gradient(k, reduction, x64):
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params = toy_lm.init_params(seed=0, dtype=dtype)
    batch = toy_lm.make_batch(seed=1)
    micro_batches = toy_lm.split(batch, k)
    whole, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)

    # optax.identity() hands the accumulated gradient straight back.
    opt = optax_accum.MultiSteps(optax.identity(), k, grad_reduction=reduction)
    err = toy_lm.rel_error(
      _window_gradient(opt, LOSSES[reduction], params, micro_batches), whole
    )

    baseline = optax.MultiSteps(optax.identity(), k, accumulator_dtype=dtype)
    state = baseline.init(params)
    for micro_batch in micro_batches:
      emitted, state = _accumulate_optax(baseline, params, state, micro_batch)
    optax_err = toy_lm.rel_error(emitted, whole)

  tol = 1e-12 if x64 else 1e-5
  msg = f"optax_accum {err:.2e}, optax.MultiSteps {optax_err:.2e} (k={k})"
  assert err <= tol, msg
  if k > 1:  # The uniform mean of micro-batch means is far off.
    assert optax_err > 1e-2 and optax_err > 1000 * tol, msg


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_adamw_trajectory_matches_whole_batch(x64):
  """30 AdamW updates with warmup-cosine: accumulated k=4 vs whole batch."""
  k, updates = 4, 30
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 5, updates, 1e-3)
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params0 = toy_lm.init_params(seed=0, dtype=dtype)
    adamw = optax.adamw(schedule, weight_decay=0.1)

    @jax.jit
    def whole_step(params, state, batch):
      grads, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
      u, state = adamw.update(grads, state, params)
      return optax.apply_updates(params, u), state

    accum = optax_accum.MultiSteps(adamw, k)

    @jax.jit
    def micro_step(params, state, micro_batch):
      u, state = _accumulate(accum, toy_lm.mean_loss, params, state, micro_batch)
      return optax.apply_updates(params, u), state

    whole_params, whole_state = params0, adamw.init(params0)
    accum_params, accum_state = params0, accum.init(params0)
    for step in range(updates):
      batch = toy_lm.make_batch(seed=100 + step)
      whole_params, whole_state = whole_step(whole_params, whole_state, batch)
      for micro_batch in toy_lm.split(batch, k):
        accum_params, accum_state = micro_step(accum_params, accum_state, micro_batch)
    diff = toy_lm.max_rel_diff(accum_params, whole_params)
    moved = toy_lm.max_rel_diff(params0, whole_params)

  assert int(accum_state.gradient_step) == updates
  assert moved > 1e-2, (
    f"params barely moved ({moved:.2e}): the test would prove nothing"
  )
  tol = 1e-11 if x64 else 1e-5
  assert diff <= tol, f"max relative params difference {diff:.2e} > {tol:.0e}"


_whole_grad = jax.jit(jax.grad(toy_lm.mean_loss, has_aux=True))
# k larger than any window here: only `end_window` closes it.
_OPEN_WINDOW = {
  r: optax_accum.MultiSteps(optax.identity(), 100, grad_reduction=r) for r in LOSSES
}


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
  cuts=st.lists(st.integers(1, 27), min_size=0, max_size=6, unique=True),
  reduction=st.sampled_from(["mean", "sum"]),
  seed=st.integers(0, 2**16),
)
def test_uneven_micro_batches_match_whole_batch(cuts, reduction, seed):
  """Any split of the batch, micro-batches of any sizes, ended by `end_window`."""
  params = toy_lm.init_params(seed=0)
  batch = toy_lm.make_batch(seed=seed)
  whole, _ = _whole_grad(params, batch)
  # Micro-batch i keeps rows [bounds[i], bounds[i+1]) and masks out the others:
  # sizes differ, shapes do not, so one compiled step serves every example.
  bounds = [0, *sorted(cuts), len(batch["mask"])]
  rows = np.arange(len(batch["mask"]))[:, None]

  opt = _OPEN_WINDOW[reduction]
  state = opt.init(params)
  for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
    micro_batch = dict(batch, mask=batch["mask"] & (lo <= rows) & (rows < hi))
    emitted, state = _accumulate_until(
      opt, LOSSES[reduction], params, state, micro_batch, i == len(bounds) - 2
    )
  assert bool(state.updated) and int(state.gradient_step) == 1
  assert toy_lm.rel_error(emitted, whole) <= 1e-5


@functools.partial(jax.jit, static_argnums=(0, 1))
def _accumulate_until(opt, loss_fn, params, state, micro_batch, end_window):
  grads, weight = jax.grad(loss_fn, has_aux=True)(params, micro_batch)
  return opt.update(grads, state, params, weight=weight, end_window=end_window)

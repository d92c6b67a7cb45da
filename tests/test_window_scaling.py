"""Adam whose decays count items, and the learning rate's window rule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum


def _grads(n, seed=0):
  rng = np.random.default_rng(seed)
  return [{"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)} for _ in range(n)]


def _run(opt, grads, weights):
  params = {"w": jnp.ones((3, 2), jnp.float32)}
  state = opt.init(params)
  for g, w in zip(grads, weights, strict=True):
    updates, state = opt.update(g, state, params, window_weight=jnp.float32(w))
    params = optax.apply_updates(params, updates)
  return params, state


def test_at_the_reference_weight_it_is_optax_adamw():
  grads = _grads(10)
  ours = optax_accum.adamw_in_items(1e-2, weight_decay=1e-3, reference_weight=64)
  theirs = optax.adamw(1e-2, weight_decay=1e-3)
  want, _ = _run(optax.with_extra_args_support(theirs), grads, [64] * 10)
  got, _ = _run(ours, grads, [64] * 10)
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)


def test_at_the_reference_weight_float64_is_optax_adamw_to_float64_rounding():
  """Float64 params give float64 arithmetic throughout: the decays, their logs,
  the bias corrections and the learning rate's factor."""
  with jax.enable_x64(True):
    ours = optax_accum.adamw_in_items(1e-2, weight_decay=1e-3, reference_weight=64)
    theirs = optax.with_extra_args_support(optax.adamw(1e-2, weight_decay=1e-3))
    params = {"w": jnp.ones((3, 2), jnp.float64)}
    state_ours, state_theirs = ours.init(params), theirs.init(params)
    for g in _grads(10):
      g = jax.tree.map(lambda x: x.astype(jnp.float64), g)
      got, state_ours = ours.update(g, state_ours, params, window_weight=64.0)
      want, state_theirs = theirs.update(g, state_theirs, params)
      assert got["w"].dtype == jnp.float64
      np.testing.assert_allclose(got["w"], want["w"], rtol=1e-12, atol=0)
      params = optax.apply_updates(params, want)


def test_moments_decay_per_item():
  """Windows of twice the items decay the moments as two windows of the
  reference do: the half-lives count items."""
  g = _grads(1)[0]
  adam = optax_accum.scale_by_adam_in_items(
    b1=0.8, b2=0.95, reference_weight=10, nu_per_item=False
  )
  _, big = _run(adam, [g] * 3, [20] * 3)
  _, small = _run(adam, [g] * 6, [10] * 6)
  for name in ("mu", "nu"):
    np.testing.assert_allclose(
      getattr(big, name)["w"], getattr(small, name)["w"], rtol=1e-6
    )
  np.testing.assert_allclose(np.exp(big.log_decay2), 0.95**6, rtol=1e-6)
  # Per item (the default), nu holds kappa g^2: twice for windows of twice.
  per_item = optax_accum.scale_by_adam_in_items(b1=0.8, b2=0.95, reference_weight=10)
  _, big = _run(per_item, [g] * 3, [20] * 3)
  np.testing.assert_allclose(big.nu["w"], 2 * small.nu["w"], rtol=1e-6)


def test_learning_rate_rule():
  g = {"w": jnp.ones(2)}
  sqrt_rule = optax_accum.scale_by_window_weight(reference_weight=8)
  linear = optax_accum.scale_by_window_weight(reference_weight=8, power=1.0)
  for rule, want in ((sqrt_rule, 2.0), (linear, 4.0)):
    u, _ = rule.update(g, rule.init(g), window_weight=32.0)
    np.testing.assert_allclose(u["w"], want)
  u, _ = sqrt_rule.update(g, sqrt_rule.init(g))  # No window weight: unscaled.
  np.testing.assert_allclose(u["w"], 1.0)


def test_in_multi_steps_the_window_weight_scales_the_step():
  """Inside MultiSteps (and optax.inject_hyperparams, for a learning rate
  counted in items) the window's weight sets the rule's factor."""
  lr = optax_accum.progress_schedule(lambda t: 0.1, unit="weight", per_update=4.0)
  inner = optax.inject_hyperparams(optax_accum.adamw_in_items)(
    learning_rate=lr, weight_decay=0.0, reference_weight=4.0
  )
  opt = optax_accum.MultiSteps(inner, every_k_schedule="end_window")
  params = jnp.zeros(2)
  state = opt.init(params)
  update = jax.jit(
    lambda s, w, end: opt.update(jnp.ones(2), s, params, weight=w, end_window=end)
  )
  u, state = update(
    state, 16.0, True
  )  # 4 times the reference: Adam's first step times 2.
  np.testing.assert_allclose(u, -0.2, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1.0, True, "64", [1.0, 2.0]])
def test_a_bad_reference_weight_is_refused(bad):
  with pytest.raises(ValueError, match="`reference_weight` must be a number > 0"):
    optax_accum.scale_by_adam_in_items(reference_weight=bad)


def test_tiny_windows_and_narrow_dtypes():
  """A window of a millionth of the reference decays by less than float32
  can tell from 1: the bias correction still divides by a positive number.
  bfloat16 gradients keep their dtype (strict promotion: no float32 mixed in)."""
  adam = optax_accum.scale_by_adam_in_items(reference_weight=1e6)
  g = {"w": jnp.ones(3, jnp.bfloat16)}
  u, state = adam.update(g, adam.init(g), window_weight=1.0)
  assert u["w"].dtype == state.mu["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(u["w"], np.float32), 1.0, rtol=1e-2)
  rule = optax_accum.scale_by_window_weight(reference_weight=2)
  u, _ = rule.update(g, rule.init(g), window_weight=8.0)
  assert u["w"].dtype == jnp.bfloat16


D, SEEDS, REF = 64, 128, 4.0
_CURVATURE = jnp.asarray(np.geomspace(0.01, 1.0, D), jnp.float32)


def _quadratic_final_losses(sizes, budget, nu_per_item):
  """A noisy quadratic, ``0.5 sum(h theta^2)``: a window of ``W`` items has
  the gradient ``h theta + N(0, I / W)`` (per-item noise of variance 1), under
  ``adamw_in_items`` with a warmup-cosine learning rate counted in items; the
  final loss of each of ``SEEDS`` runs."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, 0.02, 0.05 * budget / REF, budget / REF, end_value=0.002
  )
  lr = optax_accum.progress_schedule(schedule, unit="weight", per_update=REF)
  opt = optax.inject_hyperparams(optax_accum.adamw_in_items)(
    learning_rate=lr, weight_decay=0.0, reference_weight=REF, nu_per_item=nu_per_item
  )
  start = 3 * jax.random.normal(jax.random.key(0), (D,))

  def run(key):
    def body(carry, xs):
      theta, state = carry
      w, k = xs
      g = _CURVATURE * theta + jax.random.normal(k, (D,)) / jnp.sqrt(w)
      u, state = opt.update(g, state, theta, window_weight=w)
      return (theta + u, state), None

    keys = jax.random.split(key, len(sizes))
    xs = (jnp.asarray(sizes, jnp.float32), keys)
    (theta, _), _ = jax.lax.scan(body, (start, opt.init(start)), xs)
    return 0.5 * jnp.sum(_CURVATURE * theta**2)

  keys = jax.random.split(jax.random.key(1), SEEDS)
  return np.asarray(jax.jit(jax.vmap(run))(keys))


def test_a_change_of_window_costs_no_loss_with_the_second_moment_per_item():
  """Issue 71: windows of 4 items, then of 8 from half the budget. With ``nu``
  counted per update the switch ends above both fixed windows (its second
  moment holds the old window's noise, twice the new one's, for about 1/(1 -
  b2) windows); per item, at most at the small window's loss (paired seeds)."""
  budget = 16000.0
  small, large = [4.0] * int(budget / 4), [8.0] * int(budget / 8)
  switch = small[: len(small) // 2] + large[len(large) // 2 :]
  fixed = [_quadratic_final_losses(s, budget, True) for s in (small, large)]
  for per_item, costs in ((False, True), (True, False)):
    ended = _quadratic_final_losses(switch, budget, per_item)
    for run in fixed:
      gap = ended - run
      error = gap.std() / np.sqrt(SEEDS)
      if costs:
        assert gap.mean() > 3 * error, (gap.mean(), error)  # The cost, measured.
      else:
        assert gap.mean() < 3 * error, (gap.mean(), error)
  # A fixed window is the same either way: kappa cancels.
  np.testing.assert_allclose(
    _quadratic_final_losses(small, budget, False), fixed[0], rtol=1e-5
  )

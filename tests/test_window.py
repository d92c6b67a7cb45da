"""The window arithmetic on its own (a window of one term), with and without
jit, against NumPy."""

import chex
import jax.numpy as jnp
import numpy as np

from optax_accum._core import _reduction, _window

LOCAL = _reduction.Local()


def _run(fn, micro_batches):
  window = _window.empty({"w": jnp.zeros(3)})
  for grad, loss, weight in micro_batches:
    window, _ = fn(window, {"w": jnp.asarray(grad)}, loss, weight)
  return window


def _add(weigh, drop_nonfinite):
  def add(window, grads, loss, weight):
    kept = _window.admit(
      window,
      (grads,),
      (loss,),
      (weight,),
      reduction=LOCAL,
      drop_nonfinite=drop_nonfinite,
    )
    added = _window.add(window, (grads,), (loss,), kept, reduction=LOCAL, weigh=weigh)
    return added, kept[0]

  return add


class WindowTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_token_mean_of_random_micro_batches(self):
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(5, 3)).astype(np.float32)
    losses = rng.random(5).astype(np.float32)
    weights = np.array([3.0, 0.0, 17.0, 1.0, 8.0], np.float32)
    add = self.variant(_add(True, False))
    window = _run(add, zip(grads, losses, weights, strict=True))
    expected = (weights[:, None] * grads.astype(np.float64)).sum(0) / weights.sum()
    like = {"w": jnp.zeros(3)}
    grad, squares = _window.gradient(window, like), _window.squares(window, like)
    np.testing.assert_allclose(grad["w"], expected, rtol=1e-6)
    np.testing.assert_allclose(squares, (expected**2).sum(), rtol=1e-6)
    np.testing.assert_allclose(
      _window.mean_loss(window), (weights * losses).sum() / weights.sum(), rtol=1e-6
    )
    assert int(window[0].mini_step) == 5
    assert not bool(_window.nonfinite(window, squares))

  @chex.variants(with_jit=True, without_jit=True)
  def test_bad_weights_and_nonfinite_gradients_add_nothing(self):
    add = self.variant(_add(True, True))
    window = _window.empty({"w": jnp.zeros(3)})
    cases = [
      ([1.0, 2.0, 3.0], 1.0, 2.0, False),
      ([np.nan, 0.0, 0.0], 1.0, 5.0, True),  # Non-finite gradient: dropped.
      ([9.0, 9.0, 9.0], 1.0, -1.0, True),  # Negative weight: dropped.
      ([9.0, 9.0, 9.0], 1.0, np.inf, True),  # Infinite weight: dropped.
      ([7.0, 7.0, 7.0], 1.0, 0.0, False),  # Weight 0: adds nothing, not dropped.
    ]
    for grad, loss, weight, dropped in cases:
      window, kept = add(window, {"w": jnp.asarray(grad)}, loss, weight)
      assert bool(kept.dropped) == dropped, (grad, weight)
    grad = _window.gradient(window, {"w": jnp.zeros(3)})
    np.testing.assert_array_equal(grad["w"], [1.0, 2.0, 3.0])
    assert float(window[0].acc_weight) == 2.0 and int(window[0].mini_step) == 5

  @chex.variants(with_jit=True, without_jit=True)
  def test_reset_selects_and_a_nan_window_does_not_leak(self):
    (window,) = _window.empty({"w": jnp.zeros(2)})
    window = window._replace(
      mini_step=jnp.int32(2),
      acc_grads={"w": jnp.array([np.nan, 1.0])},
      acc_weight=jnp.float32(3.0),
    )
    squares = _window.squares((window,), {"w": jnp.zeros(2)})
    assert bool(_window.nonfinite((window,), squares))
    reset = self.variant(lambda w, ends: _window.reset((w,), ends)[0])
    kept = reset(window, jnp.array(False))
    np.testing.assert_array_equal(kept.acc_grads["w"], [np.nan, 1.0])
    emptied = reset(window, jnp.array(True))
    np.testing.assert_array_equal(emptied.acc_grads["w"], [0.0, 0.0])
    assert int(emptied.mini_step) == 0 and float(emptied.acc_weight) == 0.0
    # A window's first micro-batch overwrites whatever the sum holds (the
    # train step leaves the last window's sum there).
    fresh = (window._replace(mini_step=jnp.int32(0)),)
    ones = ({"w": jnp.ones(2)},)
    kept_in = _window.admit(fresh, ones, (None,), (2.0,), reduction=LOCAL)
    (added,) = _window.add(fresh, ones, (None,), kept_in, reduction=LOCAL)
    np.testing.assert_array_equal(added.acc_grads["w"], [2.0, 2.0])

  def test_summed_losses_are_not_weighted(self):
    window = _window.empty(jnp.zeros(()))
    for grad, weight in [(4.0, 2.0), (6.0, 3.0)]:
      kept = _window.admit(window, (grad,), (grad,), (weight,), reduction=LOCAL)
      window = _window.add(window, (grad,), (grad,), kept, reduction=LOCAL, weigh=False)
    grad = _window.gradient(window, jnp.zeros(()))
    assert float(grad) == 2.0  # (4 + 6) / (2 + 3)
    assert float(_window.mean_loss(window)) == 2.0

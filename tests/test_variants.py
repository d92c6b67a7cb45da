"""Chex variants over the public paths, each compared with the whole batch.

``with_jit``, ``without_jit`` and ``with_device`` wrap the user's code around
``MultiSteps.update`` (token weights; loss terms), ``progress_schedule`` and
the train step (streaming and scan mode; the step jits itself, so
``with_jit`` traces it in the user's own ``jit``). ``with_pmap`` maps that
code over the 8 simulated CPU devices (on an accelerator too) with
``axis_name``: each device gets a share of every micro-batch's rows.

The oracle: the inner optimizer once per window, on the gradient of the whole
window's token-mean loss (``toy_lm.whole_batch_run``). Two windows of
``K = 2`` variable-length, padded micro-batches; float32 params agree to
``rtol=1e-5``.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import toy_lm
from absl.testing import parameterized

import optax_accum

K = 2
ROWS = 16  # A window's: 8 a micro-batch, 1 a device under pmap.
BATCHES = [toy_lm.make_batch(seed=10 + window, batch=ROWS) for window in range(2)]
AXIS = "i"
DEVICES = jax.devices("cpu")[:8]
INNER = optax.sgd(0.3, momentum=0.9)  # Linear in the gradients: rounding stays small.
SCHEDULE = optax.linear_schedule(0.4, 0.1, transition_steps=3)
# The whole batch's, counting its own steps.
SCHEDULED = optax.sgd(SCHEDULE, momentum=0.9)
TERMS = ("ce", "aux")
VARIANTS = dict(with_jit=True, without_jit=True, with_device=True, with_pmap=True)


def _terms_loss(params, batch):
  """Cross-entropy over tokens and a penalty over sequences, ``{name: (value,
  weight)}``: the window's objective is the sum of their whole-window means."""
  losses, mask = toy_lm.token_losses(params, batch)
  tokens = mask.sum()
  per_sequence = losses.sum(-1) / jnp.maximum(mask.sum(-1), 1)
  sequences = (mask.sum(-1) > 0).sum().astype(jnp.float32)
  return {
    "ce": (losses.sum() / jnp.maximum(tokens, 1), tokens),
    "aux": (0.1 * (per_sequence**2).sum() / jnp.maximum(sequences, 1), sequences),
  }


def _whole_objective(params, batch):
  """The window's objective on the whole batch: the terms' sum, no weight."""
  return sum(value for value, _ in _terms_loss(params, batch).values()), None


@functools.cache
def _whole_batch(inner, loss_fn):
  """The oracle's params after both windows (computed once per optimizer)."""
  params, _, _ = toy_lm.whole_batch_run(toy_lm.init_params(), BATCHES, inner, loss_fn)
  return params


def _per_device(tree, micro_batch_axis: bool):
  """Each leaf's rows split over ``DEVICES``: a leading device axis."""
  n = len(DEVICES)

  def split(x):
    x = np.asarray(x)
    if not micro_batch_axis:
      return x.reshape(n, -1, *x.shape[1:])
    return np.swapaxes(x.reshape(x.shape[0], n, -1, *x.shape[2:]), 0, 1)

  return jax.tree.map(split, tree)


class VariantsTest(chex.TestCase):
  """``(params, state, batch)`` functions under each variant, two windows each."""

  @property
  def _pmap(self) -> bool:
    return self.variant.type == chex.ChexVariantType.WITH_PMAP

  @property
  def _axis(self) -> str | None:
    return AXIS if self._pmap else None

  def _wrap(self, fn, micro_batch_axis=False):
    """``fn(params, state, batch)`` under the variant, as the user would call it;
    under pmap, params and state replicated and the batch's rows split."""
    if not self._pmap:
      return self.variant(fn)
    if 8 % len(DEVICES):
      self.skipTest(f"with_pmap splits 8 rows over the devices: {len(DEVICES)}")
    mapped = self.variant(
      fn,
      broadcast_args_to_devices=False,
      in_axes=(None, None, 0),
      devices=DEVICES,
      n_devices=len(DEVICES),
      axis_name=AXIS,
    )
    return lambda params, state, batch: mapped(
      params, state, _per_device(batch, micro_batch_axis)
    )

  def _stream(self, step, params, state):
    """Both windows, one call per micro-batch; what each call returned."""
    outs = []
    for batch in BATCHES:
      for micro_batch in toy_lm.split(batch, K):
        params, state, *rest = step(params, state, micro_batch)
        outs.append(rest)
    return params, state, outs

  def _assert_whole_batch(self, params, inner=INNER, loss_fn=toy_lm.mean_loss):
    whole = _whole_batch(inner, loss_fn)
    self.assertGreater(toy_lm.max_rel_diff(toy_lm.init_params(), whole), 1e-2)
    chex.assert_trees_all_close(params, whole, rtol=1e-5, atol=1e-6)

  @chex.variants(**VARIANTS)
  def test_multi_steps_update_with_token_weights(self):
    opt = optax_accum.MultiSteps(INNER, K, axis_name=self._axis)

    def micro_step(params, state, batch):
      grads, tokens = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
      updates, state = opt.update(grads, state, params, weight=tokens)
      return optax.apply_updates(params, updates), state, state.updated

    params = toy_lm.init_params()
    params, state, outs = self._stream(self._wrap(micro_step), params, opt.init(params))
    self.assertEqual([bool(updated) for (updated,) in outs], [False, True] * 2)
    self.assertEqual(int(state.gradient_step), 2)
    self._assert_whole_batch(params)

  @chex.variants(**VARIANTS)
  def test_loss_terms_with_their_own_weights(self):
    opt = optax_accum.MultiSteps(INNER, K, axis_name=self._axis, terms=TERMS)

    def micro_step(params, state, batch):
      grads = {
        name: jax.grad(lambda p, name=name: _terms_loss(p, batch)[name][0])(params)
        for name in TERMS
      }
      terms = _terms_loss(params, batch)
      weight = {name: terms[name][1] for name in TERMS}
      loss = {name: terms[name][0] for name in TERMS}
      updates, state = opt.update(grads, state, params, weight=weight, loss=loss)
      return optax.apply_updates(params, updates), state

    params = toy_lm.init_params()
    params, state, _ = self._stream(self._wrap(micro_step), params, opt.init(params))
    self.assertEqual(int(state.gradient_step), 2)
    self._assert_whole_batch(params, loss_fn=_whole_objective)

  @chex.variants(**VARIANTS)
  def test_progress_schedule_counts_updates(self):
    inner = optax.inject_hyperparams(optax.sgd)(
      learning_rate=optax_accum.progress_schedule(SCHEDULE), momentum=0.9
    )
    opt = optax_accum.MultiSteps(inner, K, axis_name=self._axis)

    def micro_step(params, state, batch):
      grads, tokens = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
      updates, state = opt.update(grads, state, params, weight=tokens)
      lr = optax_accum.get_hyperparams(state)["learning_rate"]
      count = optax_accum.get_update_count(state)
      return optax.apply_updates(params, updates), state, lr, count

    params = toy_lm.init_params()
    params, _, outs = self._stream(self._wrap(micro_step), params, opt.init(params))
    # The last update's learning rate: update n (from 0) used SCHEDULE(n).
    counts = [int(count) for _, count in outs]
    self.assertEqual(counts, [0, 1, 1, 2])
    seen = [float(lr) for lr, _ in outs]
    expected = [float(SCHEDULE(max(count - 1, 0))) for count in counts]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)
    self._assert_whole_batch(params, inner=SCHEDULED)

  @chex.variants(**VARIANTS)
  @parameterized.parameters("stream", "scan")
  def test_train_step(self, mode):
    opt = optax_accum.MultiSteps(INNER, K)
    step = optax_accum.make_train_step(
      toy_lm.mean_loss, opt, mode=mode, axis_name=self._axis
    )
    # Without the user's jit the step donates params and state: fresh ones.
    params = toy_lm.init_params()
    state = opt.init(params)
    call = self._wrap(
      lambda params, state, batch: step(params, state, batch),
      micro_batch_axis=mode == "scan",
    )
    if mode == "scan":
      for batch in BATCHES:
        batch = optax_accum.split_micro_batches(batch, K)
        params, state, metrics = call(params, state, batch)
        self.assertTrue(bool(metrics["updated"]))
    else:
      params, state, outs = self._stream(call, params, state)
      updated = [bool(metrics["updated"]) for (metrics,) in outs]
      self.assertEqual(updated, [False, True] * 2)
    self.assertEqual(int(state.gradient_step), 2)
    self._assert_whole_batch(params)

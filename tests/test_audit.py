"""`audit` finds the failures it names, on setups that have them, and only there."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum

K = 4
SCHEDULE = optax.linear_schedule(0.1, 0.01, 6)


def _optimizer():
  return optax.inject_hyperparams(optax.adam)(
    learning_rate=optax_accum.progress_schedule(SCHEDULE)
  )


def _grad(params, micro_batch):
  return jax.grad(toy_lm.mean_loss, has_aux=True)(params, micro_batch)


def optax_multisteps(optimizer, k):
  """The common setup: optax.MultiSteps on per-micro-batch mean losses."""
  ms = optax.MultiSteps(optimizer, k)

  def step(params, state, micro_batch):
    grads, _ = _grad(params, micro_batch)
    updates, state = ms.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return ms.init, step


def two_function_loop(optimizer, k):
  """F7: one function drops the update, the other applies a zero one."""
  ms = optax.MultiSteps(optimizer, k)

  def step(params, state, micro_batch):
    ms_state, i = state
    grads, _ = _grad(params, micro_batch)
    updates, ms_state = ms.update(grads, ms_state, params)
    if i % k == 0:  # The loop's own counter, one micro-step late.
      params = optax.apply_updates(params, updates)
    return params, (ms_state, i + 1)

  return (lambda params: (ms.init(params), 0)), step


def micro_stepped_schedule(optimizer, k):
  """F3: token-weighted, but the optimizer (and its schedule) runs every micro-step."""

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return optimizer.init(params), zeros, 0.0, 0

  def step(params, state, micro_batch):
    opt_state, acc, total, i = state
    grads, weight = _grad(params, micro_batch)
    acc = jax.tree.map(lambda a, g: a + weight * g, acc, grads)
    total = total + weight
    mean = jax.tree.map(lambda a: a / total, acc)
    updates, opt_state = optimizer.update(mean, opt_state, params)
    if i % k == k - 1:
      params = optax.apply_updates(params, updates)
      acc, total = jax.tree.map(jnp.zeros_like, acc), 0.0
    return params, (opt_state, acc, total, i + 1)

  return init, step


def hand_loop(ends_window):
  """A token-weighted loop that runs the optimizer where `ends_window(i, k)` says."""

  def accumulation(optimizer, k):
    def init(params):
      return optimizer.init(params), jax.tree.map(jnp.zeros_like, params), 0.0, 0

    def step(params, state, micro_batch):
      opt_state, acc, total, i = state
      grads, weight = _grad(params, micro_batch)
      acc = jax.tree.map(lambda a, g: a + weight * g, acc, grads)
      total = total + weight
      if ends_window(i, k):
        mean = jax.tree.map(lambda a: a / total, acc)
        updates, opt_state = optimizer.update(mean, opt_state, params)
        params = optax.apply_updates(params, updates)
        acc, total = jax.tree.map(jnp.zeros_like, acc), 0.0
      return params, (opt_state, acc, total, i + 1)

    return init, step

  return accumulation


# A careful loop: the optimizer once, on the last micro-batch of each window.
correct_hand_loop = hand_loop(lambda i, k: i % k == k - 1)
# F4: `step % k == 0` on a 0-based count: the first update uses one micro-batch.
off_by_one_loop = hand_loop(lambda i, k: i % k == 0)


def _audit(accumulation=None, batch=None):
  return optax_accum.audit(
    toy_lm.mean_loss,
    _optimizer(),
    toy_lm.init_params(seed=0),
    toy_lm.make_batch(seed=0) if batch is None else batch,
    k=K,
    steps=3,
    accumulation=accumulation,
  )


def _found(report):
  return {f for f, v in report.verdicts.items() if v.status == "FOUND"}


def test_optax_multisteps_has_f1_and_optax_accum_is_clean():
  theirs = _audit(optax_multisteps)
  assert _found(theirs) == {"F1"} and not theirs.ok
  assert theirs.grad_error == pytest.approx(theirs.mean_of_means_bias, rel=0.05)
  assert theirs.mean_of_means_bias > 1e-2
  ours = _audit()
  assert _found(ours) == set() and ours.ok, str(ours)
  assert ours.grad_error < 1e-5 and ours.params_diff < 1e-5
  assert len(set(ours.tokens)) > 1  # Variable lengths: the check had teeth.
  text = str(theirs)
  assert "F1    mean of per-micro-batch means" in text and "fix: pass each" in text


def test_two_function_loop_is_f7():
  report = _audit(two_function_loop)
  assert "F7" in _found(report) and not report.ok
  assert not any(report.changed)


def test_schedule_stepped_on_micro_steps_is_f3():
  report = _audit(micro_stepped_schedule)
  assert _found(report) == {"F3"}, str(report)
  np.testing.assert_allclose(
    report.lr_reference, [SCHEDULE(n) for n in range(3)], rtol=1e-6
  )
  np.testing.assert_allclose(
    report.lr, [SCHEDULE(n * K + K - 1) for n in range(3)], rtol=1e-6
  )


def test_off_by_one_window_is_f4():
  report = _audit(off_by_one_loop)
  assert _found(report) == {"F4"}, str(report)
  assert report.changed[:K] == [True] + [False] * (K - 1)


def test_a_correct_hand_written_loop_passes():
  report = _audit(correct_hand_loop)
  assert report.ok and _found(report) == set(), str(report)


def test_uniform_lengths_do_not_flag_f1_on_optax_multisteps():
  batch = toy_lm.make_batch(seed=0)
  batch["mask"] = np.ones_like(batch["mask"])  # Every sequence full length.
  report = _audit(optax_multisteps, batch)
  assert report.verdicts["F1"].status == "ok", str(report)
  assert report.mean_of_means_bias < 1e-5


def test_argument_errors():
  with pytest.raises(ValueError, match=r"`k` must be an int >= 1, got 0"):
    optax_accum.audit(toy_lm.mean_loss, optax.sgd(0.1), {}, {}, k=0)
  with pytest.raises(ValueError, match=r"`batch` holds 2 batches for steps=3"):
    optax_accum.audit(toy_lm.mean_loss, optax.sgd(0.1), {}, [{}, {}], k=2)


def last_micro_batch_only(optimizer, k):
  """F6: the accumulator is overwritten instead of added to."""

  def init(params):
    return optimizer.init(params), jax.tree.map(jnp.zeros_like, params), 0

  def step(params, state, micro_batch):
    opt_state, _, i = state
    grads, _ = _grad(params, micro_batch)  # Replaces what was accumulated.
    if i % k == k - 1:
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, (opt_state, grads, i + 1)

  return init, step


def test_dropped_gradients_are_f6():
  report = _audit(last_micro_batch_only)
  assert _found(report) == {"F6"}, str(report)


def test_summed_window_gradient_is_reported_with_its_scale():
  """optax.MultiSteps(use_grad_mean=False): k times the gradient (equal lengths)."""

  def summing(optimizer, k):
    return optax_multisteps_with(optimizer, k, use_grad_mean=False)

  batch = toy_lm.make_batch(seed=0)
  batch["mask"] = np.ones_like(batch["mask"])
  report = optax_accum.audit(
    toy_lm.mean_loss,
    optax.sgd(0.1),
    toy_lm.init_params(seed=0),
    batch,
    k=K,
    steps=2,
    accumulation=summing,
  )
  assert _found(report) == {"other"}, str(report)
  assert report.grad_scale == pytest.approx(K, rel=0.05)
  assert "x the whole batch's" in report.verdicts["other"].detail
  assert report.verdicts["F1"].status == "n/a"


def optax_multisteps_with(optimizer, k, **kwargs):
  ms = optax.MultiSteps(optimizer, k, **kwargs)

  def step(params, state, micro_batch):
    grads, _ = _grad(params, micro_batch)
    updates, state = ms.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return ms.init, step


def test_no_false_alarm_on_ordinary_inputs():
  """Warmup from lr 0, bf16 params, a tuple batch, aux outputs, a donating step."""
  warmup = optax.inject_hyperparams(optax.sgd)(
    learning_rate=optax_accum.progress_schedule(
      optax.warmup_cosine_decay_schedule(0.0, 0.5, 1, 4)
    ),
    momentum=0.9,
  )
  names = ("inputs", "targets", "mask")

  def tuple_loss(params, batch):
    loss, weight = toy_lm.mean_loss(params, dict(zip(names, batch, strict=True)))
    return loss, (weight, {"tokens": weight})

  data = toy_lm.make_batch(seed=0)
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), toy_lm.init_params(seed=0))
  for params in (toy_lm.init_params(seed=0), bf16):
    report = optax_accum.audit(
      tuple_loss,
      warmup,
      params,
      tuple(data[n] for n in names),
      k=K,
      steps=2,
      has_aux=True,
    )
    assert report.ok, str(report)
    assert report.grad_error < 1e-5  # Measured on float32 copies.
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_non_finite_params_are_reported():
  def exploding(optimizer, k):
    init, step = optax_multisteps_with(optimizer, k)

    def nan_step(params, state, micro_batch):
      params, state = step(params, state, micro_batch)
      return jax.tree.map(lambda p: p * jnp.nan, params), state

    return init, nan_step

  report = _audit(exploding)
  assert "non-finite" in report.verdicts["other"].detail and not report.ok

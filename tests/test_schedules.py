"""`progress_schedule`: the LR follows real updates (F3, F4) or data (F5)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

HORIZON = 10
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1.0, 3, HORIZON, end_value=0.05)


def _sgd(schedule):
  """SGD whose learning rate is a progress schedule, visible in its state."""
  return optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)


def _lr(state):
  return float(optax_accum.get_hyperparams(state)["learning_rate"])


def _expected(n):
  return float(jax.jit(SCHEDULE)(jnp.int32(n)))


# --- Inside optax_accum.MultiSteps: update n uses schedule(n) -------------------


@pytest.mark.parametrize(
  "every_k",
  [1, 2, 4, 7, lambda step: 2 + step % 3],
  ids=["k1", "k2", "k4", "k7", "callable"],
)
def test_update_n_uses_schedule_of_n(every_k):
  """Skipped micro-batches and an empty window in the stream change nothing."""
  opt = optax_accum.MultiSteps(
    _sgd(optax_accum.progress_schedule(SCHEDULE)),
    every_k,
    should_skip_update_fn=optax.skip_not_finite,
  )
  step = jax.jit(opt.update)
  state = opt.init(jnp.zeros(3))
  used, lr_per_micro_step, window = [], [], 0
  for i in range(200):
    nan = i % 5 == 3  # A non-finite micro-batch: skipped, not counted.
    grads = jnp.full(3, jnp.nan) if nan else jnp.ones(3)
    _, state = step(grads, state, weight=jnp.float32(5), end_window=False)
    if bool(state.updated):
      used.append(_lr(state))
      window += 1
      if window == 2:  # An empty window, ended at once: no update.
        _, state = step(jnp.ones(3), state, weight=jnp.float32(0), end_window=True)
        assert not bool(state.updated)
    lr_per_micro_step.append((window, _lr(state)))
    if len(used) == HORIZON + 2:
      break
  np.testing.assert_allclose(
    used, [_expected(n) for n in range(HORIZON + 2)], rtol=1e-6
  )
  assert int(optax_accum.get_update_count(state)) == HORIZON + 2
  # F3: between two updates, every micro-step reports the same LR.
  for w in {ww for ww, _ in lr_per_micro_step}:
    assert len({lr for ww, lr in lr_per_micro_step if ww == w}) == 1


def test_decay_horizon_is_traversed_exactly_once():
  """N micro-steps with k=4 make N/4 updates and end at the final value."""
  k = 4
  opt = optax_accum.MultiSteps(_sgd(optax_accum.progress_schedule(SCHEDULE)), k)
  state = opt.init(jnp.zeros(2))
  step = jax.jit(opt.update)
  for _ in range(HORIZON * k):
    _, state = step(jnp.ones(2), state, weight=3)
  inner = state.inner_opt_state
  last_used = float(inner.hyperparams["learning_rate"])
  schedule_state = inner.hyperparams_states["learning_rate"]
  next_lr = float(optax_accum.progress_schedule(SCHEDULE)(schedule_state))
  assert int(state.gradient_step) == HORIZON
  np.testing.assert_allclose(last_used, _expected(HORIZON - 1), rtol=1e-6)
  assert last_used > 0.05 + 1e-3  # Not early: the last update still decays.
  np.testing.assert_allclose(next_lr, 0.05, rtol=1e-6)  # Not late: at the end.


def test_schedule_chained_after_accumulation_over_steps_by_k():
  """The naive pattern counts micro-steps; the adapter inside counts updates."""
  k = 4
  naive = optax.chain(
    optax_accum.MultiSteps(optax.identity(), k).gradient_transformation(),
    optax.scale_by_schedule(SCHEDULE),  # Counts every call: every micro-step.
  )
  adapted = optax_accum.MultiSteps(_sgd(optax_accum.progress_schedule(SCHEDULE)), k)
  naive_state, adapted_state = naive.init(jnp.zeros(1)), adapted.init(jnp.zeros(1))
  naive_lrs, adapted_lrs = [], []
  naive_update, adapted_update = jax.jit(naive.update), jax.jit(adapted.update)
  for i in range(3 * k):
    naive_out, naive_state = naive_update(jnp.ones(1), naive_state, weight=1)
    adapted_out, adapted_state = adapted_update(jnp.ones(1), adapted_state, weight=1)
    if i % k == k - 1:
      naive_lrs.append(float(naive_out[0]))
      adapted_lrs.append(-float(adapted_out[0]))
  np.testing.assert_allclose(adapted_lrs, [_expected(n) for n in range(3)], rtol=1e-6)
  np.testing.assert_allclose(
    naive_lrs, [_expected(n * k + k - 1) for n in range(3)], rtol=1e-6
  )
  assert abs(naive_lrs[0] - adapted_lrs[0]) > 0.5  # Update 0: 1.0 instead of 0.0.


# --- A loop that calls the optimizer on every micro-step ----------------------


def test_loop_calling_every_micro_step_passes_window_weight():
  """`window_weight` > 0 only on the call that ends a window (F3)."""
  k = 3
  adapted = _sgd(optax_accum.progress_schedule(SCHEDULE))
  plain = _sgd(SCHEDULE)  # The micro-stepped scheduler.
  adapted_state, plain_state = adapted.init(jnp.zeros(1)), plain.init(jnp.zeros(1))
  adapted_lrs, plain_lrs = [], []
  for i in range(4 * k):
    ends = i % k == k - 1
    kwargs = {"window_weight": jnp.float32(12.0 if ends else 0.0)}
    _, adapted_state = adapted.update(jnp.ones(1), adapted_state, **kwargs)
    _, plain_state = plain.update(jnp.ones(1), plain_state, **kwargs)
    adapted_lrs.append(_lr(adapted_state))
    plain_lrs.append(_lr(plain_state))
  windows = np.reshape(adapted_lrs, (4, k))
  np.testing.assert_allclose(
    windows, np.repeat([[_expected(n)] for n in range(4)], k, axis=1), rtol=1e-6
  )
  assert int(optax_accum.get_update_count(adapted_state)) == 4
  assert (
    len(set(np.reshape(plain_lrs, (4, k))[1])) == k
  )  # The bug: LR moves in a window.


# --- Dynamic batching: progress in items (F5) ---------------------------------


def _token_bounded_micro_batches(lengths, max_tokens):
  """Greedy packing of whole sequences into micro-batches of <= max_tokens."""
  batches, current = [], 0
  for length in lengths:
    if current + length > max_tokens:
      batches.append(current)
      current = 0
    current += length
  return [*batches, current]


def _lr_by_tokens(unit, micro_batches, k, per_update, schedule):
  kwargs = {"per_update": per_update} if unit == "weight" else {}
  opt = optax_accum.MultiSteps(
    _sgd(optax_accum.progress_schedule(schedule, unit=unit, **kwargs)), k
  )
  step = jax.jit(opt.update)
  state = opt.init(jnp.zeros(1))
  consumed, curve = 0, []
  for i, tokens in enumerate(micro_batches):
    last = i == len(micro_batches) - 1
    _, state = step(jnp.ones(1), state, weight=jnp.float32(tokens), end_window=last)
    if bool(state.updated):
      curve.append((consumed, _lr(state)))  # LR used by the update after `consumed`.
      consumed = sum(micro_batches[: i + 1])
  return np.array(curve)


def test_lr_follows_tokens_whatever_the_batcher_does():
  rng = np.random.default_rng(0)
  lengths = rng.integers(16, 512, size=600)
  k, per_update = 4, 4 * 2048
  horizon = lengths.sum() / per_update  # Nominal updates in the data.
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1.0, 2.0, horizon, end_value=0.0)
  small = _token_bounded_micro_batches(lengths, 512)
  large = _token_bounded_micro_batches(lengths, 2048)
  assert len(small) > 2 * len(large)  # Very different numbers of windows.

  for unit in ("weight", "updates"):
    curves = [_lr_by_tokens(unit, mb, k, per_update, schedule) for mb in (small, large)]
    follows_data = [
      np.max(np.abs(lr - np.asarray(schedule(tokens / per_update))))
      for tokens, lr in (curve.T for curve in curves)
    ]
    # The small split's LR at the token positions of the large split's updates.
    (small_tokens, small_lr), (large_tokens, large_lr) = (c.T for c in curves)
    between_splits = np.max(
      np.abs(np.interp(large_tokens, small_tokens, small_lr) - large_lr)
    )
    if unit == "weight":
      assert max(follows_data) <= 1e-6, follows_data  # Both on LR(tokens).
      assert between_splits < 1e-3, between_splits  # Up to interpolation error.
    else:  # Counting updates, each split bends the curve its own way.
      assert max(follows_data) > 0.5, follows_data
      assert between_splits > 0.5, between_splits


# --- Exact for trillions of tokens --------------------------------------------


def test_progress_stays_exact_after_a_trillion_tokens():
  per_update = 100_000
  steps = 10_000_000
  weights = 100_000 + (np.arange(steps, dtype=np.int64) * 7919) % 2001 - 1000
  exact = weights.sum() / per_update  # About 1e12 tokens: 1e7 nominal updates.
  schedule = optax_accum.progress_schedule(
    lambda p: p, unit="weight", per_update=per_update
  )

  @jax.jit
  def run(weights):
    def body(carry, w):
      state, naive = carry
      return (schedule.update(state, window_weight=w), naive + w), None

    (state, naive), _ = jax.lax.scan(body, (schedule.init(), jnp.float32(0)), weights)
    return schedule(state), naive / per_update

  value, naive = run(jnp.asarray(weights, jnp.float32))
  assert weights.sum() > 0.99e12
  assert abs(float(value) - exact) / exact <= 1e-6
  assert abs(float(naive) - exact) / exact > 1e-3  # What a float32 total does.
  assert weights.sum() > np.iinfo(np.int32).max  # And an int32 total overflows.


def test_counter_saturates_instead_of_wrapping():
  schedule = optax_accum.progress_schedule(lambda p: p, unit="weight", per_update=1)
  top = np.iinfo(np.int32).max
  state = schedule.init()._replace(whole_high=jnp.int32(top))
  for _ in range(3):
    state = schedule.update(state, window_weight=jnp.float32(1e9))
  assert int(state.whole_high) == top  # Would wrap negative.
  assert float(schedule(state)) >= top * 2.0**30


def test_weight_progress_keeps_float32_learning_rates_under_x64():
  with jax.enable_x64(True):
    lr = optax_accum.progress_schedule(SCHEDULE, unit="weight", per_update=8)
    opt = optax_accum.MultiSteps(_sgd(lr), 2)
    params = jnp.zeros(3, jnp.float32)
    state = opt.init(params)
    for _ in range(4):
      updates, state = opt.update(jnp.ones(3, jnp.float32), state, params, weight=4)
    assert updates.dtype == jnp.float32
    assert optax_accum.get_hyperparams(state)["learning_rate"].dtype == jnp.float32
    np.testing.assert_allclose(_lr(state), _expected(1), rtol=1e-6)


def test_passing_it_straight_to_an_optimizer_explains_the_fix():
  opt = optax.sgd(optax_accum.progress_schedule(SCHEDULE))
  with pytest.raises(ValueError, match=r"pass it through optax.inject_hyperparams"):
    opt.update(jnp.ones(2), opt.init(jnp.zeros(2)))


# --- Plumbing -------------------------------------------------------------------


def test_works_with_inject_stateful_hyperparams():
  with pytest.warns(
    DeprecationWarning, match="inject_stateful_hyperparams is deprecated"
  ):
    inner = optax.inject_stateful_hyperparams(optax.adamw)(
      learning_rate=optax_accum.progress_schedule(SCHEDULE), weight_decay=0.1
    )
  opt = optax_accum.MultiSteps(inner, 2)
  state = opt.init({"w": jnp.ones(2)})
  for _ in range(6):
    _, state = opt.update({"w": jnp.ones(2)}, state, {"w": jnp.ones(2)}, weight=2)
  np.testing.assert_allclose(_lr(state), _expected(2), rtol=1e-6)


def test_unit_weight_needs_window_weight():
  opt = _sgd(optax_accum.progress_schedule(SCHEDULE, unit="weight", per_update=10))
  with pytest.raises(ValueError, match="needs the extra argument `window_weight`"):
    opt.update(jnp.ones(1), opt.init(jnp.zeros(1)))


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"unit": "tokens"}, r"`unit` must be 'updates' or 'weight', got 'tokens'"),
    ({"unit": "weight"}, r"`per_update` is required with unit='weight'"),
    (
      {"unit": "weight", "per_update": 0},
      r"`per_update` must be a finite number > 0, got 0",
    ),
    (
      {"unit": "weight", "per_update": float("inf")},
      r"`per_update` must be a finite number > 0",
    ),
    ({"per_update": 512}, r"`per_update` is only used with unit='weight'"),
  ],
)
def test_constructor_errors_name_the_argument(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optax_accum.progress_schedule(SCHEDULE, **kwargs)


def test_schedule_must_be_callable():
  with pytest.raises(ValueError, match="`schedule` must be callable"):
    optax_accum.progress_schedule(0.1)


def test_is_an_optax_stateful_schedule():
  assert isinstance(
    optax_accum.progress_schedule(SCHEDULE), optax.schedules.StatefulSchedule
  )

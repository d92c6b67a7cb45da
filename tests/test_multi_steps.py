"""`optax_accum.MultiSteps`: the optax contract, windows, weights and state."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([0.5, -0.25])}


def _grads(i, params=PARAMS, scale=1.0):
  """A distinct, deterministic gradient tree for micro-step ``i``."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(i), len(leaves))
  return treedef.unflatten(
    [
      scale * jax.random.normal(k, jnp.shape(p), jnp.result_type(p))
      for k, p in zip(keys, leaves, strict=True)
    ]
  )


def _counting(calls: list) -> optax.GradientTransformation:
  """An identity transformation that records each time its update executes."""

  def update(updates, state, params=None):
    del params
    jax.debug.callback(lambda _: calls.append(1), jax.tree.leaves(updates)[0])
    return updates, state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _recording() -> optax.GradientTransformationExtraArgs:
  """An identity transformation that stores the extra arguments it was given."""

  def init(params):
    del params
    return {
      "window_weight": jnp.zeros([]),
      "window_micro_steps": jnp.zeros([], jnp.int32),
      "value": jnp.zeros([]),
    }

  def update(updates, state, params=None, **extra_args):
    del params, state
    return updates, {
      "window_weight": jnp.asarray(extra_args["window_weight"], jnp.float32),
      "window_micro_steps": jnp.asarray(extra_args["window_micro_steps"], jnp.int32),
      "value": jnp.asarray(extra_args["value"], jnp.float32),
    }

  return optax.GradientTransformationExtraArgs(init, update)


# --- Drop-in for optax.MultiSteps ---------------------------------------------


@pytest.mark.parametrize("use_grad_mean", [True, False])
@pytest.mark.parametrize(
  "every_k",
  [1, 2, 3, 5, lambda step: jnp.where(step < 2, 2, 3)],
  ids=["k1", "k2", "k3", "k5", "callable"],
)
def test_same_numbers_as_optax_without_weights(every_k, use_grad_mean):
  adam = optax.adam(0.1)
  ours = optax_accum.MultiSteps(adam, every_k, use_grad_mean=use_grad_mean)
  theirs = optax.MultiSteps(adam, every_k, use_grad_mean=use_grad_mean)
  ours_step = jax.jit(ours.update)
  theirs_step = jax.jit(theirs.update)
  p_ours, p_theirs = PARAMS, PARAMS
  s_ours, s_theirs = ours.init(PARAMS), theirs.init(PARAMS)
  for i in range(16):
    u_ours, s_ours = ours_step(_grads(i), s_ours, p_ours)
    u_theirs, s_theirs = theirs_step(_grads(i), s_theirs, p_theirs)
    chex.assert_trees_all_close(u_ours, u_theirs, rtol=1e-6, atol=1e-7)
    assert bool(ours.has_updated(s_ours)) == bool(theirs.has_updated(s_theirs)), i
    np.testing.assert_array_equal(s_ours.gradient_step, s_theirs.gradient_step)
    np.testing.assert_array_equal(s_ours.mini_step, s_theirs.mini_step)
    p_ours = optax.apply_updates(p_ours, u_ours)
    p_theirs = optax.apply_updates(p_theirs, u_theirs)
  assert int(s_ours.gradient_step) >= 3
  chex.assert_trees_all_close(p_ours, p_theirs, rtol=1e-6, atol=1e-7)


def test_same_numbers_as_optax_with_skip_function():
  sgd = optax.sgd(1.0)
  ours = optax_accum.MultiSteps(sgd, 3, should_skip_update_fn=optax.skip_not_finite)
  theirs = optax.MultiSteps(sgd, 3, should_skip_update_fn=optax.skip_not_finite)
  s_ours, s_theirs = ours.init(PARAMS), theirs.init(PARAMS)
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(99))
  stream = [_grads(0), nan, _grads(1), _grads(2), _grads(3), nan, _grads(4), _grads(5)]
  ours_step, theirs_step = jax.jit(ours.update), jax.jit(theirs.update)
  for grads in stream:
    u_ours, s_ours = ours_step(grads, s_ours, PARAMS)
    u_theirs, s_theirs = theirs_step(grads, s_theirs, PARAMS)
    chex.assert_trees_all_close(u_ours, u_theirs, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_equal(s_ours.skip_state, s_theirs.skip_state)
  assert int(s_ours.gradient_step) == 2
  chex.assert_tree_all_finite(s_ours.acc_grads)


def test_has_updated_is_false_after_a_skipped_micro_step():
  """Documented difference: optax infers it from counters and says True."""
  ours = optax_accum.MultiSteps(
    optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
  )
  theirs = optax.MultiSteps(
    optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
  )
  nan = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), _grads(0))
  s_ours, s_theirs = ours.init(PARAMS), theirs.init(PARAMS)
  flags_ours, flags_theirs = [], []
  for grads in [_grads(1), _grads(2), nan, _grads(3), _grads(4)]:
    _, s_ours = ours.update(grads, s_ours, PARAMS)
    _, s_theirs = theirs.update(grads, s_theirs, PARAMS)
    flags_ours.append(bool(ours.has_updated(s_ours)))
    flags_theirs.append(bool(theirs.has_updated(s_theirs)))
  assert flags_ours == [False, True, False, False, True]
  assert flags_theirs == [False, True, True, False, True]


def test_drop_in_for_inner_optimizers_that_reject_extra_args():
  """optax.lbfgs's line search refuses unknown extra args; it runs without ours."""
  target = {"w": jnp.full(3, 2.0)}

  def loss(p):
    return jnp.sum((p["w"] - target["w"]) ** 2)

  results = {}
  for lib in (optax, optax_accum):
    opt = lib.MultiSteps(optax.lbfgs(), 2)

    @jax.jit
    def step(params, state, opt=opt):
      value, grads = jax.value_and_grad(loss)(params)
      updates, state = opt.update(
        grads, state, params, value=value, grad=grads, value_fn=loss
      )
      return optax.apply_updates(params, updates), state

    params, state = {"w": jnp.ones(3)}, opt.init({"w": jnp.ones(3)})
    for _ in range(6):
      params, state = step(params, state)
    results[lib.__name__] = params
  chex.assert_trees_all_close(results["optax_accum"], results["optax"], rtol=1e-6)
  chex.assert_trees_all_close(results["optax_accum"], target, rtol=1e-4)


def test_window_totals_are_reserved_names():
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match=r"`window_weight` is reserved"):
    opt.update(_grads(0), opt.init(PARAMS), window_weight=3.0)


def test_inside_shard_map_with_per_device_gradients_and_state():
  """No axis_name: each device accumulates its own stream, as optax does."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec("d")
  results = {}
  for lib in (optax, optax_accum):
    opt = lib.MultiSteps(optax.adam(0.1), 2)

    def local(grads, state, opt=opt):
      squeeze = functools.partial(jax.tree.map, lambda x: x[0])
      updates, state = opt.update(squeeze(grads), squeeze(state), PARAMS)
      return jax.tree.map(lambda x: x[None], (updates, state))

    step = jax.jit(
      jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    )
    state = jax.tree.map(lambda x: jnp.stack([x] * 4), opt.init(PARAMS))
    outputs = []
    for i in range(4):
      per_device = jax.tree.map(
        lambda *g: jnp.stack(g), *[_grads(10 * i + d) for d in range(4)]
      )
      updates, state = step(per_device, state)
      outputs.append(updates)
    results[lib.__name__] = outputs
  chex.assert_trees_all_close(
    results["optax_accum"], results["optax"], rtol=1e-6, atol=1e-7
  )
  assert float(jnp.abs(results["optax_accum"][-1]["w"]).max()) > 0


def test_gradient_transformation_chains_and_forwards_weight():
  ms = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  chained = optax.chain(optax.clip_by_global_norm(1e6), ms.gradient_transformation())
  state = chained.init(PARAMS)
  _, state = chained.update(_grads(0), state, PARAMS, weight=1)
  updates, state = chained.update(_grads(1), state, PARAMS, weight=3)
  expected = jax.tree.map(lambda a, b: -(a + 3 * b) / 4, _grads(0), _grads(1))
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)
  assert ms.inner_opt.update is not None and bool(ms.has_updated(state[1]))


def test_multi_steps_itself_in_a_chain_gets_weight(recwarn):
  """Issue 60: ``optax.chain`` dropped ``weight=`` before a ``MultiSteps``
  (2.0 where the token mean is 2.5) and warned that none was given."""
  ms = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  chained = optax.chain(optax.clip_by_global_norm(1e6), ms)
  state = chained.init(PARAMS)
  update = jax.jit(chained.update)
  _, state = update(_grads(0), state, PARAMS, weight=1)
  updates, state = update(_grads(1), state, PARAMS, weight=3)
  expected = jax.tree.map(lambda a, b: -(a + 3 * b) / 4, _grads(0), _grads(1))
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)
  assert not [w for w in recwarn if "weight" in str(w.message)]
  assert jax.tree.leaves(ms) == [] and isinstance(ms, optax.GradientTransformation)


# --- Windows: the inner optimizer runs once, on the right micro-step ------------


def test_inner_optimizer_runs_once_per_window_under_jit():
  k, windows = 4, 3
  ours_calls, theirs_calls = [], []
  ours = optax_accum.MultiSteps(_counting(ours_calls), k)
  theirs = optax.MultiSteps(_counting(theirs_calls), k)
  s_ours, s_theirs = ours.init(PARAMS), theirs.init(PARAMS)
  ours_step, theirs_step = jax.jit(ours.update), jax.jit(theirs.update)
  for i in range(k * windows):
    _, s_ours = ours_step(_grads(i), s_ours, PARAMS)
    _, s_theirs = theirs_step(_grads(i), s_theirs, PARAMS)
  jax.effects_barrier()
  # On a GPU the inner optimizer runs on every call and a select keeps what
  # it must not change (docs/accelerators.md): no host round trip.
  on_gpu = jax.default_backend() in ("cuda", "rocm", "gpu")
  assert len(ours_calls) == (k * windows if on_gpu else windows)
  assert len(theirs_calls) == k * windows  # optax 0.2.8 runs it every micro-step.


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_windows_hold_exactly_k_and_mid_steps_change_nothing(k):
  """F4: the first update comes after exactly k micro-steps, and so does each."""
  opt = optax_accum.MultiSteps(optax.adamw(0.1), k)
  step = jax.jit(opt.update)
  params, state = PARAMS, opt.init(PARAMS)
  updated = []
  for i in range(3 * k):
    before = params
    updates, state = step(_grads(i), state, params)
    params = optax.apply_updates(params, updates)
    updated.append(bool(state.updated))
    if not state.updated:
      chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
      chex.assert_trees_all_equal(params, before)  # bit-identical
    else:
      assert all(
        bool(jnp.any(a != b))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True)
      )
  assert updated == ([False] * (k - 1) + [True]) * 3
  assert int(state.gradient_step) == 3 and int(state.mini_step) == 0


def test_end_window_closes_a_partial_window_under_jit():
  opt = optax_accum.MultiSteps(optax.identity(), 4)
  step = jax.jit(lambda g, s, w, end: opt.update(g, s, weight=w, end_window=end))
  state = opt.init(PARAMS)
  _, state = step(_grads(0), state, 2, False)
  out, state = step(_grads(1), state, 6, True)  # Early end, traced flag.
  expected = jax.tree.map(lambda a, b: (2 * a + 6 * b) / 8, _grads(0), _grads(1))
  chex.assert_trees_all_close(out, expected, rtol=1e-6)
  assert bool(state.updated) and int(state.mini_step) == 0
  # The next window is a full k = 4 again.
  flags = []
  for i in range(4):
    _, state = step(_grads(i), state, 1, False)
    flags.append(bool(state.updated))
  assert flags == [False, False, False, True]


def test_inner_optimizer_receives_window_totals_and_extra_args():
  opt = optax_accum.MultiSteps(_recording(), 3)
  state = opt.init(PARAMS)
  for i, w in enumerate([5, 0, 7]):
    _, state = opt.update(_grads(i), state, weight=w, value=jnp.float32(i))
  inner = state.inner_opt_state
  assert float(inner[optax_accum.WINDOW_WEIGHT]) == 12.0
  assert int(inner[optax_accum.WINDOW_MICRO_STEPS]) == 3
  assert float(inner["value"]) == 2.0


def test_loss_reaches_the_inner_optimizer_as_the_windows_value():
  """`loss=` gives `value` the window's token-mean loss (reduce_on_plateau)."""
  opt = optax_accum.MultiSteps(_recording(), 3)
  state = opt.init(PARAMS)
  for i, (w, loss) in enumerate([(5, 1.0), (0, 9.0), (3, 5.0)]):
    _, state = opt.update(_grads(i), state, weight=w, loss=loss)
  assert float(state.inner_opt_state["value"]) == (5 * 1.0 + 3 * 5.0) / 8
  with pytest.raises(ValueError, match=r"Pass `loss=` or `value=`, not both"):
    opt.update(_grads(0), state, weight=1, loss=1.0, value=1.0)


def test_the_finished_windows_loss_and_weight_stay_readable():
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  state = opt.init(PARAMS)
  assert float(state.last_window_loss) == float(state.last_window_weight) == 0
  windows = [[(2, 3.0), (6, 1.0)], [(1, 4.0), (1, 2.0)]]
  for window in windows:
    for i, (w, loss) in enumerate(window):
      _, state = opt.update(_grads(i), state, PARAMS, weight=w, loss=loss)
      if i == 0:  # Mid-window: still the previous window's.
        kept = (float(state.last_window_loss), float(state.last_window_weight))
    mean = sum(w * loss for w, loss in window) / sum(w for w, _ in window)
    assert float(state.acc_loss) == float(state.acc_weight) == 0  # Reset.
    assert float(state.last_window_loss) == pytest.approx(mean, rel=1e-6)
    assert float(state.last_window_weight) == sum(w for w, _ in window)
  assert kept == (1.5, 8.0)  # During window 2: window 1's (3*2 + 1*6) / 8.


def test_a_state_saved_without_the_last_window_fields_restores():
  """Checkpoints from before `last_window_*` (a state built from the first
  fields) run on and fill them in, as `micro_batches_seen` did."""
  opt = optax_accum.MultiSteps(optax.adamw(0.1), 2)
  full = opt.init(PARAMS)
  _, full = opt.update(_grads(0), full, PARAMS, weight=2, loss=1.0)
  old = optax_accum.MultiStepsState(*full[:11])
  step = jax.jit(functools.partial(opt.update, weight=2, loss=3.0))
  out_old, old = step(_grads(1), old, PARAMS)
  out_full, full = step(_grads(1), full, PARAMS)
  chex.assert_trees_all_equal((out_old, old), (out_full, full))
  assert float(old.last_window_loss) == 2.0 and float(old.last_window_weight) == 4


def test_window_mean_sums_shares_of_the_windows_mean():
  """grad_reduction="window_mean": each loss is summed over its items and divided
  by the window's total (Hugging Face's num_items_in_batch)."""
  weights = [1.0, 10.0, 3.0]
  sums = [_grads(i) for i in range(3)]  # Gradients of each micro-batch's sum.
  total = sum(weights)
  expected = jax.tree.map(lambda *g: sum(g) / total, *sums)
  for use_grad_mean in (True, False):  # No effect: the sum is the mean.
    opt = optax_accum.MultiSteps(
      optax.identity(), 3, use_grad_mean, grad_reduction="window_mean"
    )
    state = opt.init(PARAMS)
    for g, w, loss_sum in zip(sums, weights, [2.0, 30.0, 6.0], strict=True):
      share = jax.tree.map(lambda x: x / total, g)
      out, state = opt.update(share, state, weight=w, loss=loss_sum / total)
    chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-7)
    assert float(state.last_window_loss) == pytest.approx(38 / 14, rel=1e-6)
    assert float(state.last_window_weight) == total
  assert opt.grad_reduction == "window_mean"
  # Without weights it still works; the weight then counts micro-batches.
  opt = optax_accum.MultiSteps(optax.identity(), 3, grad_reduction="window_mean")
  state = opt.init(PARAMS)
  for g in sums:
    out, state = opt.update(jax.tree.map(lambda x: x / total, g), state)
  chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-7)
  assert float(state.last_window_weight) == 3


def test_window_mean_refuses_to_drop_a_micro_batch_alone():
  """Issue 26, item 1: each window_mean loss is divided by a total that counts
  every micro-batch, so dropping one alone shrank the update to the kept
  share (0.909x). The combination is refused; a bad weight drops the window."""
  with pytest.raises(ValueError, match=r"window_mean.*skip_window"):
    optax_accum.MultiSteps(
      optax.sgd(1.0), 4, grad_reduction="window_mean", on_nonfinite="skip_micro_batch"
    )
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 3, grad_reduction="window_mean")
  state = opt.init(PARAMS)
  for i, w in enumerate([4.0, jnp.nan, 6.0, 1.0, 2.0, 3.0]):
    out, state = opt.update(_grads(i), state, PARAMS, weight=w)
    if i == 2:  # The window with the NaN weight: no update, counted twice.
      assert not bool(state.updated)
      assert int(state.skipped_micro_batches) == 1
      assert int(state.skipped_windows) == 1
      chex.assert_trees_all_equal(out, jax.tree.map(jnp.zeros_like, PARAMS))
  # The next window is whole again.
  assert bool(state.updated) and int(state.gradient_step) == 1
  expected = jax.tree.map(lambda *g: -sum(g), _grads(3), _grads(4), _grads(5))
  chex.assert_trees_all_close(out, expected, rtol=1e-6)


def test_no_recompilation_across_windows():
  opt = optax_accum.MultiSteps(optax.adamw(0.1), 3)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(grads, state, params, weight, end_window):
    return opt.update(grads, state, params, weight=weight, end_window=end_window)

  state = opt.init(PARAMS)
  for i in range(9):
    _, state = step(_grads(i), state, PARAMS, jnp.float32(i + 1), jnp.array(i == 4))
  # Windows: micro-steps 0-2, 3-4 (ended early), 5-7, and 8 still open.
  assert int(state.gradient_step) == 3 and int(state.mini_step) == 1


# --- Weights --------------------------------------------------------------------


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_weighted_mean_and_weighted_sum(use_grad_mean):
  opt = optax_accum.MultiSteps(optax.identity(), 3, use_grad_mean=use_grad_mean)
  state = opt.init(PARAMS)
  weights = [1.0, 10.0, 3.0]
  for i, w in enumerate(weights):
    out, state = opt.update(_grads(i), state, weight=w)
  total = sum(
    w * g for w, g in zip(weights, [_grads(i)["w"] for i in range(3)], strict=True)
  )
  expected = total / sum(weights) if use_grad_mean else total
  np.testing.assert_allclose(out["w"], expected, rtol=1e-6)


def test_sum_reduction_divides_by_total_weight_only():
  opt = optax_accum.MultiSteps(optax.identity(), 2, grad_reduction="sum")
  state = opt.init(PARAMS)
  _, state = opt.update(_grads(0), state, weight=4)
  out, state = opt.update(_grads(1), state, weight=12)
  np.testing.assert_allclose(
    out["b"], (_grads(0)["b"] + _grads(1)["b"]) / 16, rtol=1e-6
  )
  assert opt.grad_reduction == "sum"


def test_zero_weight_window_applies_nothing_and_is_not_counted():
  opt = optax_accum.MultiSteps(optax.adamw(0.1), 2)
  state = opt.init(PARAMS)
  _, state = opt.update(_grads(0), state, PARAMS, weight=1)
  _, state = opt.update(_grads(1), state, PARAMS, weight=1)
  inner_before = state.inner_opt_state
  # A window of two all-padding micro-batches: 0/0 gives NaN gradients.
  nan = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), _grads(2))
  for _ in range(2):
    updates, state = opt.update(nan, state, PARAMS, weight=0)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
  assert (
    not bool(state.updated)
    and int(state.gradient_step) == 1
    and int(state.mini_step) == 0
  )
  chex.assert_trees_all_equal(state.inner_opt_state, inner_before)
  chex.assert_trees_all_equal(
    state.acc_grads, jax.tree.map(jnp.zeros_like, state.acc_grads)
  )
  # The next window is clean.
  _, state = opt.update(_grads(3), state, PARAMS, weight=1)
  updates, state = opt.update(_grads(4), state, PARAMS, weight=1)
  chex.assert_tree_all_finite(updates)
  assert int(state.gradient_step) == 2


@pytest.mark.parametrize("bad", [-3.0, float("nan"), float("inf")])
def test_bad_weight_counts_towards_k_but_adds_nothing(bad):
  opt = optax_accum.MultiSteps(optax.identity(), 3)
  state = opt.init(PARAMS)
  _, state = opt.update(_grads(0), state, weight=2)
  _, state = opt.update(
    jax.tree.map(lambda g: g * jnp.nan, _grads(1)), state, weight=bad
  )
  assert int(state.skipped_micro_batches) == 1
  out, state = opt.update(_grads(2), state, weight=6)
  assert bool(state.updated)
  expected = jax.tree.map(lambda a, b: (2 * a + 6 * b) / 8, _grads(0), _grads(2))
  chex.assert_trees_all_close(out, expected, rtol=1e-6)


def test_nan_window_does_not_leak_into_the_next():
  """F8: reset by selection. optax 0.2.8 multiplies by 0 and stays NaN forever."""
  poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(0))
  stream = [poisoned, _grads(1), _grads(2), _grads(3)]
  ours = optax_accum.MultiSteps(optax.identity(), 2)
  theirs = optax.MultiSteps(optax.identity(), 2)
  s_ours, s_theirs = ours.init(PARAMS), theirs.init(PARAMS)
  for grads in stream:
    u_ours, s_ours = ours.update(grads, s_ours)
    u_theirs, s_theirs = theirs.update(grads, s_theirs)
  expected = jax.tree.map(lambda a, b: (a + b) / 2, _grads(2), _grads(3))
  chex.assert_trees_all_close(u_ours, expected, rtol=1e-6)
  assert not bool(jnp.all(jnp.isfinite(u_theirs["w"])))  # What we fix.


def test_an_accumulator_with_mini_step_zero_counts_as_empty():
  """`make_train_step` leaves a finished window's sum behind (no zeroing pass)."""
  opt = optax_accum.MultiSteps(optax.identity(), 2)
  fresh = opt.init(PARAMS)
  stale = fresh._replace(
    acc_grads=jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), fresh.acc_grads)
  )
  outs = []
  for state in (fresh, stale):
    for i in range(2):
      out, state = jax.jit(opt.update)(_grads(i), state, weight=i + 1)
    outs.append(out)
  chex.assert_trees_all_equal(outs[1], outs[0])
  chex.assert_tree_all_finite(outs[1])


def test_window_weight_beyond_two_to_the_24_rounds_only_slightly():
  """Millions of tokens per window: float32 totals round, relative <= 6e-8 each."""
  weights = [10_000_001.0, 10_000_003.0, 10_000_005.0]  # Sum > 2**24.
  grads = [{"w": jnp.full(3, g)} for g in (0.25, -1.5, 3.0)]
  opt = optax_accum.MultiSteps(optax.identity(), 3)
  state = opt.init({"w": jnp.zeros(3)})
  for g, w in zip(grads, weights, strict=True):
    out, state = opt.update(g, state, weight=w)
  exact = sum(w * float(g["w"][0]) for g, w in zip(grads, weights, strict=True))
  exact /= sum(weights)
  assert sum(weights) > 2**24
  np.testing.assert_allclose(out["w"], exact, rtol=5e-7)


# --- Dtypes ---------------------------------------------------------------------


def test_bf16_params_get_bf16_gradients_from_a_float32_accumulator():
  """F9: 64 terms of 1 + 2**-9 sum exactly in float32 but not in bfloat16."""
  params = {"w": jnp.zeros((4,), jnp.bfloat16)}
  grad = {"w": jnp.full((4,), 1.0 + 2.0**-9, jnp.float32).astype(jnp.bfloat16)}
  small = {"w": jnp.full((4,), 2.0**-9, jnp.bfloat16)}
  results = {}
  for acc_dtype in (None, jnp.bfloat16):
    opt = optax_accum.MultiSteps(
      optax.identity(), 64, use_grad_mean=False, accumulator_dtype=acc_dtype
    )
    state = opt.init(params)
    assert state.acc_grads["w"].dtype == (
      jnp.float32 if acc_dtype is None else jnp.bfloat16
    )
    step = jax.jit(opt.update)
    for i in range(64):
      out, state = step(grad if i == 0 else small, state)
    assert out["w"].dtype == jnp.bfloat16
    results[acc_dtype] = float(out["w"][0])
  exact = float(grad["w"][0]) + 63 * 2.0**-9
  assert abs(results[None] - exact) <= 2.0**-7 * exact  # One bf16 rounding.
  assert abs(results[jnp.bfloat16] - exact) > 0.05  # bf16 sums drop the small terms.


def test_a_narrow_accumulator_keeps_weights_and_products_in_float32():
  """Issue 16, item 3: weights and `weight * grad` stay float32 whatever
  `accumulator_dtype` is; only the sum is stored narrow."""
  # float16: 70000 is inf, 70000 * 1e-3 = 70 is not.
  opt = optax_accum.MultiSteps(optax.identity(), 1, accumulator_dtype=jnp.float16)
  out, state = opt.update(
    {"w": jnp.full(2, 1e-3)}, opt.init({"w": jnp.zeros(2)}), weight=70000.0
  )
  assert bool(state.updated) and int(state.skipped_windows) == 0
  np.testing.assert_allclose(out["w"], 1e-3, rtol=1e-3)
  # bfloat16: the weight 257 (256 in bfloat16) multiplies in float32; 257 * 3 =
  # 771 rounds once, to 772, and the denominator is 257.
  opt = optax_accum.MultiSteps(optax.identity(), 1, accumulator_dtype=jnp.bfloat16)
  out, state = opt.update(
    {"w": jnp.full(2, 3.0)}, opt.init({"w": jnp.zeros(2)}), weight=257.0
  )
  assert state.acc_weight.dtype == jnp.float32
  np.testing.assert_allclose(out["w"], np.float32(772) / np.float32(257), rtol=1e-7)


def test_float64_params_keep_a_float64_accumulator():
  with jax.enable_x64(True):
    opt = optax_accum.MultiSteps(optax.identity(), 2)
    state = opt.init({"w": jnp.zeros(3, jnp.float64)})
    assert state.acc_grads["w"].dtype == jnp.float64
    assert state.acc_weight.dtype == jnp.float64


def test_update_needs_no_implicit_promotion():
  """Our own code under strict promotion: mixed leaves, int and float weights."""
  params = {"a": jnp.zeros(3, jnp.float32), "b": jnp.zeros(2, jnp.bfloat16)}
  opt = optax_accum.MultiSteps(optax.identity(), 2)
  with jax.numpy_dtype_promotion("strict"):
    state = opt.init(params)
    _, state = jax.jit(opt.update)(
      jax.tree.map(jnp.ones_like, params), state, weight=jnp.int32(3)
    )
    out, state = jax.jit(opt.update)(
      jax.tree.map(jnp.ones_like, params), state, weight=2.5
    )
  assert out["b"].dtype == jnp.bfloat16 and bool(state.updated)
  np.testing.assert_allclose(out["a"], 1.0)


# --- State and errors -----------------------------------------------------------


def test_state_fields():
  state = optax_accum.MultiSteps(optax.sgd(1.0), 2).init(PARAMS)
  assert state._fields == (
    "mini_step",
    "gradient_step",
    "inner_opt_state",
    "acc_grads",
    "acc_weight",
    "acc_loss",
    "updated",
    "skipped_micro_batches",
    "skipped_windows",
    "skip_state",
    "micro_batches_seen",
    "last_window_loss",
    "last_window_weight",
    "noise_scale",
    "held",
  )

  # Without noise_scale=True the pytree is release 0.1.0's (its checkpoints
  # restore against it: test_legacy_checkpoints.py); with it, one node more;
  # a streamed coupled window's held micro-batches, one node more again.
  def top(s):
    children = jax.tree_util.tree_flatten_with_path(s, is_leaf=lambda x: x is not s)
    return tuple(p[0].name for p, _ in children[0])

  assert top(state) == state._fields[:-2]
  measured = optax_accum.MultiSteps(optax.sgd(1.0), 2, noise_scale=True).init(PARAMS)
  assert top(measured) == state._fields[:-1]
  holding = state._replace(held=({"x": jnp.zeros(2)},))
  assert top(holding) == (*state._fields[:-2], "held")
  assert jax.tree.map(lambda x: x, holding).held[0]["x"].shape == (2,)
  assert jax.tree.map(lambda x: x, state).noise_scale is None
  assert state.micro_batches_seen.dtype == jnp.int32
  assert state.mini_step.dtype == state.gradient_step.dtype == jnp.int32
  assert state.acc_weight.dtype == jnp.float32 and state.updated.dtype == jnp.bool_
  assert state.last_window_loss.dtype == state.last_window_weight.dtype == jnp.float32


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"every_k_schedule": 0}, r"`every_k_schedule` must be >= 1, got 0"),
    ({"every_k_schedule": -2}, r"`every_k_schedule` must be >= 1, got -2"),
    ({"every_k_schedule": 2.0}, r"`every_k_schedule` must be an int.*2\.0"),
    ({"every_k_schedule": True}, r"`every_k_schedule` must be an int"),
    ({"every_k_schedule": "4"}, r"`every_k_schedule` must be an int"),
    (
      {"every_k_schedule": 2, "grad_reduction": "avg"},
      r"`grad_reduction` must be 'mean', 'sum' or 'window_mean', got 'avg'",
    ),
    ({"every_k_schedule": 2, "use_grad_mean": 1}, r"`use_grad_mean` must be a bool"),
  ],
)
def test_constructor_errors_name_the_argument(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optax_accum.MultiSteps(optax.sgd(1.0), **kwargs)


def test_use_grad_mean_accepts_numpy_bools():
  opt = optax_accum.MultiSteps(optax.identity(), 1, use_grad_mean=np.bool_(False))
  out, _ = opt.update(_grads(0), opt.init(PARAMS), weight=2.0)
  chex.assert_trees_all_close(out, jax.tree.map(lambda g: 2 * g, _grads(0)), rtol=1e-6)


def test_opt_must_be_a_gradient_transformation():
  with pytest.raises(
    ValueError, match=r"`opt` must be an optax.GradientTransformation"
  ):
    optax_accum.MultiSteps(optax.sgd, 2)  # The factory, not the transformation.


@pytest.mark.parametrize(
  ("weight", "match"),
  [
    (jnp.ones(2), r"`weight` must be a scalar, got shape \(2,\)"),
    ("12", r"`weight` must be a real number, got dtype <U2"),
    (jnp.array(True), r"`weight` must be a real number, got dtype bool"),
  ],
)
def test_bad_weight_raises_at_trace_time(weight, match):
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match=match):
    opt.update(_grads(0), opt.init(PARAMS), weight=weight)


def test_sum_reduction_requires_weight():
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2, grad_reduction="sum")
  with pytest.raises(
    ValueError, match=r"`weight` is required with grad_reduction='sum'"
  ):
    opt.update(_grads(0), opt.init(PARAMS))


@pytest.mark.parametrize(
  ("grads", "match"),
  [
    ({"w": jnp.zeros((2, 3))}, r"`updates` is missing leaf \['b'\]"),
    ({**PARAMS, "c": jnp.zeros(1)}, r"`updates` has leaf \['c'\]"),
    (
      {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)},
      r"`updates` leaf \['w'\] has shape \(3, 2\)",
    ),
  ],
)
def test_gradient_tree_mismatch_names_the_first_path(grads, match):
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match=match):
    jax.jit(opt.update)(grads, opt.init(PARAMS))


def test_integer_params_are_rejected_with_their_path():
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match=r"`params` leaf \['step'\] has dtype int32"):
    opt.init({"w": jnp.zeros(2), "step": jnp.zeros([], jnp.int32)})


def test_frozen_leaves_stay_bit_identical_through_multi_transform():
  """Frozen params: label them for `optax.set_to_zero` inside the accumulator."""
  labels = {"w": "train", "b": "frozen"}
  inner = optax.multi_transform(
    {"train": optax.adam(0.1), "frozen": optax.set_to_zero()}, labels
  )
  opt = optax_accum.MultiSteps(inner, 2)
  params, state = PARAMS, opt.init(PARAMS)
  for i in range(6):
    updates, state = jax.jit(opt.update)(_grads(i), state, params, weight=i + 1)
    params = optax.apply_updates(params, updates)
  assert int(state.gradient_step) == 3
  np.testing.assert_array_equal(params["b"], PARAMS["b"])
  assert float(jnp.abs(params["w"] - PARAMS["w"]).max()) > 0.1


def test_vmap_over_update_gives_each_stream_its_window():
  opt = optax_accum.MultiSteps(optax.adam(0.1), 2)
  streams = 3
  states = jax.vmap(lambda _: opt.init(PARAMS))(jnp.arange(streams))
  for i in range(2):
    grads = jax.tree.map(
      lambda *g: jnp.stack(g), *[_grads(10 * s + i) for s in range(streams)]
    )
    weights = jnp.arange(1.0, streams + 1) * (i + 1)
    out, states = jax.vmap(lambda g, st, w: opt.update(g, st, weight=w))(
      grads, states, weights
    )
  for s in range(streams):
    state = opt.init(PARAMS)
    for i in range(2):
      want, state = opt.update(_grads(10 * s + i), state, weight=(s + 1.0) * (i + 1))
    chex.assert_trees_all_close(jax.tree.map(lambda x, s=s: x[s], out), want, rtol=1e-6)
  assert np.asarray(states.gradient_step).tolist() == [1] * streams


def test_end_window_must_be_a_bool_scalar():
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match=r"`end_window` must be a boolean"):
    opt.update(_grads(0), opt.init(PARAMS), end_window=1.0)


def test_run_time_k_below_one_means_every_micro_step():
  opt = optax_accum.MultiSteps(optax.identity(), lambda step: jnp.int32(0))
  state = opt.init(PARAMS)
  _, state = opt.update(_grads(0), state)
  assert bool(state.updated) and int(state.gradient_step) == 1


# --- chex variants --------------------------------------------------------------


class VariantsTest(chex.TestCase):
  """One window of three weighted micro-steps, under each execution variant."""

  @chex.variants(with_jit=True, without_jit=True, with_device=True, with_pmap=True)
  def test_window_is_the_weighted_mean(self):
    if jax.device_count() < 2 and self.variant.type == chex.ChexVariantType.WITH_PMAP:
      self.skipTest("with_pmap needs more than one device")
    pmap = self.variant.type == chex.ChexVariantType.WITH_PMAP
    # chex's pmap axis: every replica has the same micro-batches here.
    opt = optax_accum.MultiSteps(optax.sgd(1.0), 3, axis_name="i" if pmap else None)
    step = self.variant(functools.partial(opt.update, params=None))
    state = opt.init(PARAMS)
    weights = [3.0, 1.0, 4.0]
    flags = []
    for i, w in enumerate(weights):
      out, state = step(_grads(i), state, weight=jnp.float32(w))
      flags.append(bool(state.updated))
    expected = jax.tree.map(
      lambda a, b, c: -(3 * a + b + 4 * c) / 8, _grads(0), _grads(1), _grads(2)
    )
    self.assertEqual(flags, [False, False, True])
    chex.assert_trees_all_close(out, expected, rtol=1e-6)


def test_init_gives_every_state_leaf_its_own_buffer():
  """A state donated to the user's own jit donates leaf by leaf: two fields
  sharing one zero array made XLA refuse the call (or crash inside shard_map)."""
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 2)
  state = opt.init(PARAMS)
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  assert len({id(x) for x in leaves}) == len(leaves)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, grads):
    return opt.update(grads, state, PARAMS)[1]

  state = step(state, _grads(0))
  assert int(state.mini_step) == 1


@pytest.mark.parametrize("device", [0, -1])
def test_update_in_your_jit_compiles_once_with_committed_params(device, caplog):
  """``opt.init`` commits the state to the device ``params`` are committed to,
  as the user's ``jit`` returns it: the README's step compiles once (with its
  scalars uncommitted it compiled again on the second call)."""
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), 2)
  on = jax.devices()[device]
  params = jax.device_put({"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}, on)
  state = opt.init(params)

  @jax.jit
  def train_step(params, state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"][None]) ** 2))(params)
    updates, state = opt.update(grads, state, params, weight=x.shape[0])
    return optax.apply_updates(params, updates), state

  with caplog.at_level("WARNING"), jax.log_compiles(True):
    for i in range(4):
      params, state = train_step(params, state, jnp.full((2, 3), float(i)))
  compiles = [r for r in caplog.records if "Compiling jit(train_step" in r.getMessage()]
  assert len(compiles) == 1
  assert {d for x in jax.tree.leaves(state) for d in x.devices()} == {on}
  assert int(state.gradient_step) == 2

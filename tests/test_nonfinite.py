"""Non-finite gradients: skip the micro-batch or the whole window, and count it."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum

K = 4
AUTO = jax.sharding.AxisType.Auto
POLICIES = ["skip_window", "skip_micro_batch"]


@functools.cache
def _three_windows():
  params = toy_lm.init_params(seed=0)
  grad = jax.jit(functools.partial(toy_lm.grad_and_weight, toy_lm.mean_loss))
  stream = []
  for w in range(3):
    for mb in toy_lm.split(toy_lm.make_batch(seed=w), K):
      stream.append(grad(params, mb))
  return params, tuple(stream)


def _stream(windows: int = 3):
  """``windows`` (up to 3) windows of K micro-batches with their gradients and
  weights: computed once, shared by the tests (the arrays are immutable)."""
  params, stream = _three_windows()
  return params, stream[: windows * K]


def _poison(grads, value):
  """``grads`` with one element of one leaf set to ``value``."""
  return {**grads, "head": {**grads["head"], "b": grads["head"]["b"].at[3].set(value)}}


def _run(opt, params, stream):
  """Feeds ``stream`` through ``opt`` under jit; returns params and states."""
  step = jax.jit(opt.update)
  state, states = opt.init(params), []
  for grads, weight in stream:
    updates, state = step(grads, state, params, weight=weight)
    params = optax.apply_updates(params, updates)
    states.append(state)
  return params, states


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_skip_window_drops_the_whole_window_atomically(bad):
  params, stream = _stream()
  opt = optax_accum.MultiSteps(toy_lm.adamw_with_schedule(), K)
  poisoned = list(stream)
  poisoned[K + 1] = (_poison(stream[K + 1][0], bad), stream[K + 1][1])
  got, states = _run(opt, params, poisoned)

  skipped = states[2 * K - 1]  # The state after the poisoned window ended.
  assert not bool(skipped.updated)
  assert int(skipped.gradient_step) == 1 and int(skipped.mini_step) == 0
  assert int(skipped.skipped_windows) == 1 and int(skipped.skipped_micro_batches) == 0
  # Inner state and the schedule's count are those of the window before.
  chex.assert_trees_all_equal(skipped.inner_opt_state, states[K - 1].inner_opt_state)
  chex.assert_trees_all_equal(
    skipped.acc_grads, jax.tree.map(jnp.zeros_like, skipped.acc_grads)
  )
  # The run is the run that never saw the window: nothing leaks into the next.
  want, _ = _run(opt, params, stream[:K] + stream[2 * K :])
  chex.assert_trees_all_equal(got, want)
  assert int(states[-1].gradient_step) == 2


@pytest.mark.parametrize("where", ["grads", "loss"])
def test_skip_micro_batch_keeps_the_rest_of_the_window(where):
  params, stream = _stream(windows=1)
  opt = optax_accum.MultiSteps(
    optax.identity(), K, on_nonfinite="skip_micro_batch", use_grad_mean=True
  )
  state = opt.init(params)
  step = jax.jit(opt.update)
  for i, (grads, weight) in enumerate(stream):
    loss = jnp.float32(1.0)
    if i == 2:
      grads = _poison(grads, jnp.nan) if where == "grads" else grads
      loss = jnp.float32(jnp.nan) if where == "loss" else loss
    out, state = step(grads, state, weight=weight, loss=loss)
  assert bool(state.updated)
  assert int(state.skipped_micro_batches) == 1 and int(state.skipped_windows) == 0
  kept = [s for i, s in enumerate(stream) if i != 2]
  total = sum(float(w) for _, w in kept)
  want = jax.tree.map(lambda *g: g[0] * 0, kept[0][0])
  for grads, weight in kept:
    want = jax.tree.map(lambda a, g, w=weight: a + float(w) * g, want, grads)
  chex.assert_trees_all_close(out, jax.tree.map(lambda x: x / total, want), rtol=2e-6)


@pytest.mark.parametrize("policy", POLICIES)
def test_all_padding_micro_batch_with_nan_gradient_is_not_a_skip(policy):
  """0 tokens: mean loss 0/0 is NaN, but weight 0 adds nothing and drops nothing."""
  params, stream = _stream(windows=1)
  opt = optax_accum.MultiSteps(optax.identity(), K, on_nonfinite=policy)
  padding = (jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), stream[0][0]), 0.0)
  _, states = _run(opt, params, [padding, *stream[1:]])
  _, clean = _run(opt, params, [(stream[0][0], 0.0), *stream[1:]])
  assert bool(states[-1].updated)
  assert int(states[-1].skipped_micro_batches) == int(states[-1].skipped_windows) == 0
  chex.assert_trees_all_equal(states[-1], clean[-1])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_window_that_overflows_is_skipped_under_either_policy(policy):
  """Finite micro-batches whose weighted sum overflows float32 are caught too."""
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2, on_nonfinite=policy)
  params = {"w": jnp.ones(3)}
  state = opt.init(params)
  huge = {"w": jnp.full(3, 3e38)}
  for _ in range(2):
    updates, state = opt.update(huge, state, params, weight=2.0)
  assert int(state.skipped_windows) == 1 and int(state.skipped_micro_batches) == 0
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(3)})


@pytest.mark.parametrize("how", ["update", "train_step"])
def test_a_window_gradient_that_overflows_float16_params_is_skipped(how):
  """Issue 16, item 2: the float32 sum 90000 is finite, its cast to float16 is
  not; it must not reach the params."""
  k = 3
  opt = optax_accum.MultiSteps(optax.sgd(1.0), k, use_grad_mean=False)
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  grads = {"w": jnp.full(2, 30.0, jnp.float16)}
  if how == "update":
    step = jax.jit(opt.update)
    for _ in range(k):
      updates, state = step(grads, state, params, weight=1000.0)
    params = optax.apply_updates(params, updates)
  else:

    def loss_fn(params, batch):
      return jnp.sum(params["w"] * batch).astype(jnp.float32), jnp.float32(1000)

    step = optax_accum.make_train_step(loss_fn, opt)
    for _ in range(k):
      params, state, metrics = step(params, state, grads["w"])
    assert not bool(metrics["updated"]) and int(metrics["skipped_windows"]) == 1
  assert not bool(state.updated) and int(state.gradient_step) == 0
  assert int(state.skipped_windows) == 1
  np.testing.assert_array_equal(params["w"], np.ones(2, np.float16))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_huge_sum_with_a_finite_window_gradient_is_applied(jit):
  """The check is on the window gradient, not on the weighted sum: a sum above
  ~1e19 (whose square overflows float32) divided by its weight is fine, and so
  is a single huge element, eagerly and under jit alike (XLA simplifies
  sqrt(x * x) to |x| for one element, so a check on the norm's overflow gave
  one answer under jit and another eagerly)."""
  for use_grad_mean, grads, weight, want in [
    (True, {"w": jnp.full(2, 1e10)}, 1e10, -1e10),
    (False, {"w": jnp.float32(9e19)}, 1.0, -9e19),
  ]:
    opt = optax_accum.MultiSteps(optax.sgd(1.0), 1, use_grad_mean=use_grad_mean)
    update = jax.jit(opt.update) if jit else opt.update
    state = opt.init(jax.tree.map(jnp.zeros_like, grads))
    out, state = update(grads, state, weight=weight)
    assert bool(state.updated) and int(state.skipped_windows) == 0, use_grad_mean
    np.testing.assert_allclose(out["w"], want, rtol=1e-6)


def test_a_bad_weight_on_one_replica_drops_the_micro_batch_on_all():
  """A NaN or negative weight on one replica drops the whole micro-batch, on
  every replica (counted once), as a non-finite gradient does: the other
  replicas' parts of it must not enter the window alone."""
  devices = 4
  if jax.device_count() < devices:
    pytest.skip("needs 4 devices")
  spec = jax.sharding.PartitionSpec("data")
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(AUTO,))
  opt = optax_accum.MultiSteps(optax.identity(), 2, axis_name="data")

  def window(grads, weights):
    state = opt.init({"w": jnp.zeros(3)})
    for i in range(2):
      updates, state = opt.update({"w": grads[0, i]}, state, weight=weights[0, i])
    return jax.tree.map(lambda x: x[None], (updates, state))

  grads = np.arange(devices * 2 * 3, dtype=np.float32).reshape(devices, 2, 3)
  for bad in (np.nan, -2.0):
    weights = np.full((devices, 2), 2.0, np.float32)
    weights[1, 0] = bad  # Replica 1's first micro-batch.
    run = jax.jit(
      jax.shard_map(window, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    )
    updates, state = run(grads, weights)
    np.testing.assert_array_equal(state.skipped_micro_batches, 1)
    np.testing.assert_array_equal(state.gradient_step, 1)
    for replica in range(devices):  # Only the second micro-batch is in.
      np.testing.assert_allclose(updates["w"][replica], grads[:, 1].mean(axis=0))


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize("policy", POLICIES)
def test_train_step_reports_skips_and_keeps_params(mode, policy):
  def loss_fn(params, batch):
    loss, weight = toy_lm.mean_loss(params, batch)
    return loss * jnp.prod(batch["scale"]), weight  # A NaN row poisons it all.

  opt = optax_accum.MultiSteps(optax.adamw(1e-2), K, on_nonfinite=policy)
  step = optax_accum.make_train_step(loss_fn, opt, mode=mode, donate=False)
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  batch = toy_lm.make_batch(seed=0)
  scale = np.ones(len(batch["mask"]), np.float32)
  scale[1] = np.nan  # Row 1: micro-batch 1 of the window (rows i::K).
  batch["scale"] = scale
  new_params, state, metrics = toy_lm.feed_window(step, params, state, batch, K, mode)
  skipped_window = policy == "skip_window"
  assert int(metrics["skipped_windows"]) == int(skipped_window)
  assert int(metrics["skipped_micro_batches"]) == int(not skipped_window)
  assert bool(metrics["updated"]) is not skipped_window
  if skipped_window:
    chex.assert_trees_all_equal(new_params, params)
  else:
    chex.assert_tree_all_finite(new_params)
    assert toy_lm.max_rel_diff(new_params, params) > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_replicas_agree_on_what_to_skip_under_shard_map(policy):
  devices = 4
  if jax.device_count() < devices:
    pytest.skip("needs 4 devices")
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec("data")
  params = {"w": jnp.zeros(3)}
  opt = optax_accum.MultiSteps(
    optax.identity(), 2, axis_name="data", on_nonfinite=policy
  )

  def window(grads, weights):
    state = opt.init(params)
    for i in range(2):
      updates, state = opt.update({"w": grads[0, i]}, state, weight=weights[0, i])
    return jax.tree.map(lambda x: x[None], (updates, state))

  grads = np.arange(devices * 2 * 3, dtype=np.float32).reshape(devices, 2, 3)
  grads[2, 1, 0] = np.nan  # Replica 2's second micro-batch.
  weights = np.full((devices, 2), 2.0, np.float32)
  run = jax.jit(jax.shard_map(window, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
  updates, state = run(grads, weights)
  for name in ("skipped_windows", "skipped_micro_batches", "updated"):
    assert len(set(np.asarray(getattr(state, name)).tolist())) == 1, name
  if policy == "skip_window":
    np.testing.assert_array_equal(updates["w"], 0.0)
    np.testing.assert_array_equal(state.skipped_windows, 1)
  else:  # The second micro-batch is dropped on every replica.
    np.testing.assert_allclose(updates["w"][0], grads[:, 0].mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(state.skipped_micro_batches, 1)


def test_skip_counters_saturate():
  top = jnp.iinfo(jnp.int32).max
  nan = {"w": jnp.full(2, jnp.nan)}
  for policy, counter in [
    ("skip_micro_batch", "skipped_micro_batches"),
    ("skip_window", "skipped_windows"),
  ]:
    opt = optax_accum.MultiSteps(optax.identity(), 1, on_nonfinite=policy)
    state = opt.init({"w": jnp.zeros(2)})._replace(**{counter: jnp.int32(top)})
    _, state = opt.update(nan, state)
    assert int(getattr(state, counter)) == top, policy


def test_policy_is_checked():
  with pytest.raises(ValueError, match=r"`on_nonfinite` must be 'skip_window' or"):
    optax_accum.MultiSteps(optax.sgd(1.0), 2, on_nonfinite="raise")
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2, on_nonfinite="skip_micro_batch")
  assert opt.on_nonfinite == "skip_micro_batch"


@pytest.mark.parametrize("policy", POLICIES)
def test_model_shards_agree_on_what_to_skip(policy):
  """Params sharded over a `model` axis inside shard_map: one shard's NaN is
  every shard's, or half the model would update and its counters drift."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  P = jax.sharding.PartitionSpec
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AUTO, AUTO))
  opt = optax_accum.MultiSteps(
    optax.adam(0.1), 2, axis_name="data", on_nonfinite=policy
  )

  def window(params, grads):
    state = opt.init(params)
    for i in range(2):
      updates, state = opt.update({"w": grads[0, i]}, state, params, weight=1.0)
    counters = (state.gradient_step, state.skipped_windows, state.skipped_micro_batches)
    return optax.apply_updates(params, updates), jnp.stack(counters)[None, None]

  grads = np.ones((2, 2, 4), np.float32)  # [data, micro-batch, model * features]
  grads[0, 1, 0] = np.nan  # Replica 0, micro-batch 1, model shard 0 only.
  run = jax.jit(
    jax.shard_map(
      window,
      mesh=mesh,
      in_specs=(P("model"), P("data", None, "model")),
      out_specs=(P("model"), P("data", "model")),
    )
  )
  params, counters = run({"w": jnp.zeros(4)}, grads)
  counters = np.asarray(counters).reshape(4, 3)
  assert (counters == counters[0]).all(), counters
  moved = np.asarray(params["w"]) != 0
  assert moved.all() or not moved.any(), params
  assert counters[0].tolist() == ([0, 1, 0] if policy == "skip_window" else [1, 0, 1])


def test_independent_per_device_windows_skip_independently():
  """`axis_name=()`: each device's window is its own, and so is its NaN."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  spec = jax.sharding.PartitionSpec("d")
  mesh = jax.make_mesh((4,), ("d",), axis_types=(AUTO,))
  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2, axis_name=())

  def window(grads, weights):
    state = opt.init({"w": jnp.zeros(3)})
    for i in range(2):
      updates, state = opt.update({"w": grads[0, i]}, state, weight=weights[0, i])
    return updates["w"][None], state.skipped_windows[None]

  grads = np.ones((4, 2, 3), np.float32)
  grads[1, 0, 2] = np.nan  # Device 1's window only.
  weights = np.ones((4, 2), np.float32)
  run = jax.jit(jax.shard_map(window, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
  updates, skipped = run(grads, weights)
  assert np.asarray(skipped).tolist() == [0, 1, 0, 0]
  np.testing.assert_array_equal(updates[1], 0.0)
  np.testing.assert_array_equal(np.delete(np.asarray(updates), 1, axis=0), -1.0)

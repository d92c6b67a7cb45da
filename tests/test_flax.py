"""Flax NNX and Linen models train with optax_accum as they would on the whole batch."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from flax_models import (
  CLASSES,
  FEATURES,
  HIDDEN,
  MLP,
  K,
  linen_mlp,
  make_batches,
  micro_batches,
  rel,
  token_mean_ce,
)

import optax_accum
import optax_accum.flax

UPDATES = 8


# --- NNX ------------------------------------------------------------------------


def _nnx_whole_batch_params():
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    grads = nnx.grad(lambda m: token_mean_ce(m(batch["x"]), batch)[0])(model)
    optimizer.update(model, grads)

  for batch in make_batches(UPDATES):
    step(model, optimizer, batch)
  return nnx.state(model, nnx.Param)


def test_nnx_split_merge_with_make_train_step():
  graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    return token_mean_ce(model(batch["x"]), batch)

  opt = optax_accum.MultiSteps(optax.adam(1e-2), K)
  step = optax_accum.make_train_step(loss_fn, opt)
  state = opt.init(params)
  losses = []
  for batch in make_batches(UPDATES):
    for micro_batch in micro_batches(batch):
      params, state, metrics = step(params, state, micro_batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  assert rel(params, _nnx_whole_batch_params()) <= 1e-5


def test_nnx_optimizer_forwards_weight():
  model = MLP(nnx.Rngs(0))
  adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  optimizer = nnx.Optimizer(model, optax_accum.MultiSteps(adam, K), wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, batch):
    def loss(m):
      return token_mean_ce(m(batch["x"]), batch)

    grads, weight = nnx.grad(loss, has_aux=True)(model)
    optimizer.update(model, grads, weight=weight)

  for batch in make_batches(UPDATES):
    for micro_batch in micro_batches(batch):
      micro_step(model, optimizer, micro_batch)
  assert rel(nnx.state(model, nnx.Param), _nnx_whole_batch_params()) <= 1e-5
  # The logging helpers read through nnx's variables.
  lr = optax_accum.get_hyperparams(optimizer.opt_state)["learning_rate"]
  assert f"{lr:.0e}" == "1e-02"
  assert int(optax_accum.get_update_count(optimizer.opt_state)) == UPDATES


def test_flax_wrappers_forward_weight_through_a_chain():
  """Issue 60: ``TrainState(tx=optax.chain(..., MultiSteps))`` and the NNX
  ``Optimizer`` lost ``weight=`` inside the chain."""
  from optax_accum.flax import Optimizer, TrainState

  grads = [jnp.array([1.0]), jnp.array([3.0])]
  tx = optax.chain(optax.identity(), optax_accum.MultiSteps(optax.sgd(1.0), 2))
  state = TrainState.create(apply_fn=None, params=jnp.zeros(1), tx=tx)
  for g, w in zip(grads, (1, 3), strict=True):
    state = state.apply_gradients(grads=g, weight=w)
  assert float(state.params[0]) == -2.5
  model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
  before = float(model.kernel[...][0, 0])
  tx = optax.chain(optax.identity(), optax_accum.MultiSteps(optax.sgd(1.0), 2))
  optimizer = Optimizer(model, tx, wrt=nnx.Param)
  for g, w in zip(grads, (1, 3), strict=True):
    grad = nnx.grad(lambda m, g=g: (m(jnp.ones((1, 1))) * g[0]).sum())(model)
    optimizer.update(model, grad, weight=w)
  assert float(model.kernel[...][0, 0]) - before == -2.5


# --- Linen ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_linen_apply_params_with_make_train_step(mode):
  _, params0, loss_fn = linen_mlp()
  batches = make_batches(UPDATES)
  adam = optax.adam(1e-2)
  whole, whole_state = params0, adam.init(params0)
  for batch in batches:
    grads, _ = jax.grad(loss_fn, has_aux=True)(whole, batch)
    updates, whole_state = adam.update(grads, whole_state, whole)
    whole = optax.apply_updates(whole, updates)

  opt = optax_accum.MultiSteps(adam, K)
  step = optax_accum.make_train_step(loss_fn, opt, mode=mode)
  params = jax.tree.map(jnp.copy, params0)
  state = opt.init(params)
  first_loss = None
  for batch in batches:
    if mode == "scan":
      params, state, metrics = step(
        params, state, optax_accum.split_micro_batches(batch, K)
      )
    else:
      for micro_batch in micro_batches(batch):
        params, state, metrics = step(params, state, micro_batch)
    first_loss = float(metrics["loss"]) if first_loss is None else first_loss
  assert float(metrics["loss"]) < first_loss
  assert rel(params, whole) <= 1e-5


# --- k = 1: a plain optax optimizer (issue 69, item 3) ----------------------------
#
# EasyLM wraps `optax.MultiSteps` only when `accumulate_gradient_steps > 1`; its
# default of 1 hands the TrainState a plain optax optimizer, with `weight=`.
# The wrappers then run Flax's own update, so params, optimizer state and step
# are bit-identical to Flax's; a zero, negative, NaN or inf weight drops the
# micro-batch, as `MultiSteps(tx, 1)` does (a window of no items).

BAD_WEIGHTS = (0.0, -1.0, float("nan"), float("inf"))


class _LinenAttention(nn.Module):
  """Self-attention and a dense head, with dropout in both."""

  @nn.compact
  def __call__(self, x, *, train):
    x = nn.Dense(HIDDEN)(x)
    x = x + nn.MultiHeadDotProductAttention(
      num_heads=2, dropout_rate=0.2, deterministic=not train, broadcast_dropout=False
    )(x)
    x = nn.Dropout(0.2, deterministic=not train)(jax.nn.tanh(x))
    return nn.Dense(CLASSES)(x)


class _NNXAttention(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=2,
      in_features=HIDDEN,
      dropout_rate=0.2,
      broadcast_dropout=False,
      deterministic=False,
      decode=False,
      rngs=rngs,
    )
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = self.embed(x)
    x = x + self.attention(x)
    return self.out(self.dropout(jax.nn.tanh(x)))


def _tx():
  return optax.adamw(1e-2, weight_decay=0.1)


def _assert_trees_equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves_a, leaves_b, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _linen_states(tx):
  model = _LinenAttention()
  x = make_batches(1)[0]["x"]
  params = model.init(jax.random.key(0), x, train=False)["params"]
  ours = optax_accum.flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  theirs = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  return ours, theirs


@functools.partial(jax.jit, static_argnames="with_weight")
def _linen_step(state, batch, weight_scale, *, with_weight):
  """Flax's Linen step (a dropout key folded from the step), `weight=` added."""
  key = jax.random.fold_in(jax.random.key(1), state.step)

  def loss(params):
    logits = state.apply_fn(
      {"params": params}, batch["x"], train=True, rngs={"dropout": key}
    )
    return token_mean_ce(logits, batch)

  grads, n = jax.grad(loss, has_aux=True)(state.params)
  if not with_weight:
    return state.apply_gradients(grads=grads)
  return state.apply_gradients(grads=grads, weight=n * weight_scale)


def test_linen_train_state_with_a_plain_optimizer_is_linen_s_own():
  """Item 3: `optax_accum.flax.TrainState(tx=optax.adamw(...))` with `weight=`
  trains bit for bit as `flax.training.train_state.TrainState`, jitted, for
  several steps, on an attention model with dropout; the state is the same."""
  ours, theirs = _linen_states(_tx())
  for batch in make_batches(UPDATES):
    ours = _linen_step(ours, batch, 1.0, with_weight=True)
    theirs = _linen_step(theirs, batch, 1.0, with_weight=False)
    _assert_trees_equal(
      (ours.params, ours.opt_state), (theirs.params, theirs.opt_state)
    )
    assert int(ours.step) == int(theirs.step)
  assert int(ours.step) == int(ours.micro_step) == UPDATES
  # Eagerly too, and without `weight=` (Linen's own call, as it is).
  batch = make_batches(UPDATES + 1)[-1]
  grads = jax.grad(
    lambda p: token_mean_ce(
      theirs.apply_fn({"params": p}, batch["x"], train=False), batch
    )[0]
  )(theirs.params)
  want = theirs.apply_gradients(grads=grads)
  for got in (
    ours.apply_gradients(grads=grads, weight=7),
    ours.apply_gradients(grads=grads),
  ):
    _assert_trees_equal((got.params, got.opt_state), (want.params, want.opt_state))
    assert int(got.step) == UPDATES + 1


def test_linen_plain_optimizer_drops_a_bad_weight_as_multi_steps_with_k_one():
  """Item 3: a zero, negative, NaN or inf weight drops the micro-batch (no
  update, step unchanged), as `optax_accum.MultiSteps(tx, 1)` does; the run then
  goes on as if it had not happened. One compile for all of them."""
  ours, theirs = _linen_states(_tx())
  batches = make_batches(4)
  for batch in batches[:2]:  # Two steps: the step is an array from then on.
    ours = _linen_step(ours, batch, 1.0, with_weight=True)
    theirs = _linen_step(theirs, batch, 1.0, with_weight=False)
  accumulator = optax_accum.MultiSteps(_tx(), 1)
  acc_state = accumulator.init(ours.params)
  compiled = _linen_step._cache_size()
  for scale in BAD_WEIGHTS:
    dropped = _linen_step(ours, batches[2], scale, with_weight=True)
    _assert_trees_equal(
      (dropped.params, dropped.opt_state), (ours.params, ours.opt_state)
    )
    assert int(dropped.step) == int(ours.step) == 2
    grads = jax.tree.map(jnp.ones_like, ours.params)
    _, acc_after = accumulator.update(grads, acc_state, ours.params, weight=scale)
    assert int(optax_accum.get_update_count(acc_after)) == 0  # The same choice.
  assert _linen_step._cache_size() == compiled  # The weight is traced.
  for batch in batches[2:]:
    ours = _linen_step(ours, batch, 1.0, with_weight=True)
    theirs = _linen_step(theirs, batch, 1.0, with_weight=False)
  _assert_trees_equal((ours.params, ours.opt_state), (theirs.params, theirs.opt_state))


def test_linen_plain_optimizer_passes_loss_as_value():
  """Item 3: `loss=` reaches the optimizer as `value`, as MultiSteps passes the
  window's loss (a window of one: the micro-batch's), for reduce_on_plateau."""
  _, params, loss_fn = linen_mlp()
  tx = optax.chain(_tx(), optax.contrib.reduce_on_plateau(factor=0.5, patience=0))
  state = optax_accum.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
  plain, plain_state = params, tx.init(params)
  for batch in make_batches(3):
    (loss, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    state = state.apply_gradients(grads=grads, weight=n, loss=loss)
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(plain, batch)
    updates, plain_state = tx.update(grads, plain_state, plain, value=loss)
    plain = optax.apply_updates(plain, updates)
  _assert_trees_equal((state.params, state.opt_state), (plain, plain_state))


def test_linen_plain_optimizer_state_restores_from_orbax(tmp_path):
  """Item 3: the state (Linen's own layout) saves and restores with orbax, and
  the run resumes bit-identical; a checkpoint of Linen's own TrainState
  restores into it, as the state is the same."""
  ocp = pytest.importorskip("orbax.checkpoint")
  batches = make_batches(4)
  ours, theirs = _linen_states(_tx())
  for batch in batches[:2]:
    ours = _linen_step(ours, batch, 1.0, with_weight=True)
    theirs = _linen_step(theirs, batch, 1.0, with_weight=False)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ours", ours)
  checkpointer.save(tmp_path / "theirs", theirs)
  checkpointer.wait_until_finished()
  uninterrupted = ours
  for batch in batches[2:]:
    uninterrupted = _linen_step(uninterrupted, batch, 1.0, with_weight=True)
  fresh, _ = _linen_states(_tx())
  for name in ("ours", "theirs"):
    state = ocp.StandardCheckpointer().restore(tmp_path / name, fresh)
    assert isinstance(state, optax_accum.flax.TrainState)
    for batch in batches[2:]:
      state = _linen_step(state, batch, 1.0, with_weight=True)
    _assert_trees_equal(
      (state.params, state.opt_state), (uninterrupted.params, uninterrupted.opt_state)
    )
    assert int(state.step) == 4


def _nnx_run(optimizer_type, weights):
  """`len(weights)` steps of the NNX attention model; `None` leaves `weight=` out."""
  model = _NNXAttention(nnx.Rngs(0, dropout=1))
  optimizer = optimizer_type(model, _tx(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, scale):
    def loss(model):
      return token_mean_ce(model(batch["x"]), batch)

    grads, n = nnx.grad(loss, has_aux=True)(model)
    if scale is None:
      return optimizer.update(model, grads)
    return optimizer.update(model, grads, weight=n * scale)

  snapshots = []
  for batch, scale in zip(make_batches(len(weights)), weights, strict=True):
    step(model, optimizer, batch, scale)
    snapshot = (nnx.state(model, nnx.Param), optimizer.opt_state, optimizer.step)
    snapshots.append(jax.tree.map(np.array, nnx.as_pure(snapshot)))  # Copies.
  return model, optimizer, snapshots


def test_nnx_optimizer_with_a_plain_optimizer_is_nnx_s_own():
  """Item 3: `optax_accum.flax.Optimizer(model, optax.adamw(...))` with
  `weight=` trains bit for bit as `nnx.Optimizer`, on an attention model with
  dropout; the optimizer state and step are the same."""
  _, ours, got = _nnx_run(optax_accum.flax.Optimizer, [1.0] * UPDATES)
  _, _, want = _nnx_run(nnx.Optimizer, [None] * UPDATES)
  for a, b in zip(got, want, strict=True):
    _assert_trees_equal(a, b)
  assert int(ours.step[...]) == int(ours.micro_step) == UPDATES


@pytest.mark.parametrize("bad", BAD_WEIGHTS)
def test_nnx_plain_optimizer_drops_a_bad_weight(bad):
  """Item 3: a bad weight leaves model, state and step as they were; the model's
  dropout key still advances, as it would for any call."""
  _, _, got = _nnx_run(optax_accum.flax.Optimizer, [1.0, bad, 1.0])
  _assert_trees_equal(got[1][:2], got[0][:2])
  assert [int(s[2]) for s in got] == [1, 1, 2]
  _, _, want = _nnx_run(nnx.Optimizer, [None, None])
  _assert_trees_equal(got[0], want[0])


def test_nnx_plain_optimizer_eagerly_and_with_loss():
  """Item 3: eagerly too (a weight known in Python: nnx.Optimizer's own ops),
  a bad weight drops the call; `loss=` reaches the optimizer as `value`, and
  `value=` beside it is refused, as MultiSteps refuses it."""
  batch = make_batches(1)[0]
  tx = optax.chain(_tx(), optax.contrib.reduce_on_plateau(factor=0.5, patience=0))
  models = [MLP(nnx.Rngs(0)) for _ in range(2)]
  ours = optax_accum.flax.Optimizer(models[0], tx, wrt=nnx.Param)
  theirs = nnx.Optimizer(models[1], tx, wrt=nnx.Param)

  def loss(model):
    return token_mean_ce(model(batch["x"]), batch)

  for weight in (3, 0, float("nan"), 5):
    (value, n), grads = nnx.value_and_grad(loss, has_aux=True)(models[0])
    ours.update(models[0], grads, weight=weight, loss=value)
    if weight > 0:
      (value, n), grads = nnx.value_and_grad(loss, has_aux=True)(models[1])
      theirs.update(models[1], grads, value=value)
    _assert_trees_equal(
      nnx.as_pure((nnx.state(models[0], nnx.Param), ours.opt_state, ours.step)),
      nnx.as_pure((nnx.state(models[1], nnx.Param), theirs.opt_state, theirs.step)),
    )
  assert int(ours.step[...]) == 2
  with pytest.raises(ValueError, match=r"`loss=` or `value=`, not both"):
    ours.update(models[0], grads, weight=n, loss=value, value=value)

"""Flax NNX and Linen models train with optax_accum as they would on the whole batch."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_accum

FEATURES, HIDDEN, CLASSES, K, UPDATES = 6, 16, 5, 4, 8


def _batches():
  """Per-token features and labels; sequences of very different lengths."""
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(UPDATES):
    x = rng.normal(size=(16, 12, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=(16, 12))
    lengths = np.where(
      rng.random(16) < 0.5, rng.integers(1, 3, 16), rng.integers(8, 13, 16)
    )
    mask = np.arange(12)[None, :] < lengths[:, None]
    batches.append({"x": x, "labels": labels, "mask": mask})
  return batches


def _token_mean_ce(logits, batch):
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
  mask = jnp.asarray(batch["mask"], ce.dtype)
  return (ce * mask).sum() / mask.sum(), mask.sum()


def _micro_batches(batch):
  return [jax.tree.map(lambda x, i=i: x[i::K], batch) for i in range(K)]


def _rel(a, b):
  return float(optax.tree.norm(jax.tree.map(jnp.subtract, a, b)) / optax.tree.norm(b))


# --- NNX ------------------------------------------------------------------------


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.tanh(self.hidden(x)))


def _nnx_whole_batch_params():
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    grads = nnx.grad(lambda m: _token_mean_ce(m(batch["x"]), batch)[0])(model)
    optimizer.update(model, grads)

  for batch in _batches():
    step(model, optimizer, batch)
  return nnx.state(model, nnx.Param)


def test_nnx_split_merge_with_make_train_step():
  graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    return _token_mean_ce(model(batch["x"]), batch)

  opt = optax_accum.MultiSteps(optax.adam(1e-2), K)
  step = optax_accum.make_train_step(loss_fn, opt)
  state = opt.init(params)
  losses = []
  for batch in _batches():
    for micro_batch in _micro_batches(batch):
      params, state, metrics = step(params, state, micro_batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  assert _rel(params, _nnx_whole_batch_params()) <= 1e-5


def test_nnx_optimizer_forwards_weight():
  model = MLP(nnx.Rngs(0))
  adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  optimizer = nnx.Optimizer(model, optax_accum.MultiSteps(adam, K), wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, batch):
    def loss(m):
      return _token_mean_ce(m(batch["x"]), batch)

    grads, weight = nnx.grad(loss, has_aux=True)(model)
    optimizer.update(model, grads, weight=weight)

  for batch in _batches():
    for micro_batch in _micro_batches(batch):
      micro_step(model, optimizer, micro_batch)
  assert _rel(nnx.state(model, nnx.Param), _nnx_whole_batch_params()) <= 1e-5
  # The logging helpers read through nnx's variables.
  lr = optax_accum.get_hyperparams(optimizer.opt_state)["learning_rate"]
  assert f"{lr:.0e}" == "1e-02"
  assert int(optax_accum.get_update_count(optimizer.opt_state)) == UPDATES


# --- Linen ----------------------------------------------------------------------


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(jax.nn.tanh(nn.Dense(HIDDEN)(x)))


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_linen_apply_params_with_make_train_step(mode):
  model = LinenMLP()
  batches = _batches()
  params0 = model.init(jax.random.key(0), batches[0]["x"])["params"]

  def loss_fn(params, batch):
    return _token_mean_ce(model.apply({"params": params}, batch["x"]), batch)

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
      for micro_batch in _micro_batches(batch):
        params, state, metrics = step(params, state, micro_batch)
    first_loss = float(metrics["loss"]) if first_loss is None else first_loss
  assert float(metrics["loss"]) < first_loss
  assert _rel(params, whole) <= 1e-5

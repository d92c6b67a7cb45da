"""Flax NNX and Linen models train with optax_accum as they would on the whole batch."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax_models import (
  MLP,
  K,
  linen_mlp,
  make_batches,
  micro_batches,
  rel,
  token_mean_ce,
)

import optax_accum

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

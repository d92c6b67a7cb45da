"""`should_skip_update_fn` sees the same gradient with and without replicas.

Issue 43, item 5: with `axis_name` the function saw each replica's own
gradient, the default path and one device the whole micro-batch's, so
`optax.skip_large_updates` rejected micro-batches on 8 replicas that one
device accepts (a replica's gradient of few rows is larger). Now it sees the
micro-batch's gradient over all replicas everywhere: 8 replicas end where one
device does, rejecting the same micro-batches.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, MICRO_BATCHES, ROWS, REPLICAS = 2, 8, 16, 8
#: Between the micro-batches' squared gradient norms on one device: some pass.
MAX_SQUARED_NORM = 4.0
PARAMS = {"w": np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)}


def _mean_loss(params, batch):
  error = ((batch["x"] @ params["w"] - batch["y"]) ** 2).sum(-1) * batch["mask"]
  return error.sum() / jnp.maximum(batch["mask"].sum(), 1.0), batch["mask"].sum()


def _sum_loss(params, batch):
  error = ((batch["x"] @ params["w"] - batch["y"]) ** 2).sum(-1) * batch["mask"]
  return error.sum(), batch["mask"].sum()


LOSSES = {"mean": _mean_loss, "sum": _sum_loss}


def _micro_batches():
  rng = np.random.default_rng(1)
  return [
    {
      "x": rng.normal(size=(ROWS, 3)).astype(np.float32),
      "y": rng.normal(size=(ROWS, 2)).astype(np.float32),
      "mask": (rng.random(ROWS) < 0.7).astype(np.float32),
    }
    for _ in range(MICRO_BATCHES)
  ]


def _rows(batch, mesh):
  """A micro-batch's rows split over the replicas."""
  return jax.device_put(batch, NamedSharding(mesh, P("data")))


def _opt(reduction="mean", axis_name=None):
  scale = 1.0 if reduction == "mean" else 0.1  # A summed loss's larger gradient.
  skip = functools.partial(
    optax.skip_large_updates, max_squared_norm=MAX_SQUARED_NORM / scale**2
  )
  return optax_accum.MultiSteps(
    optax.sgd(0.05 * scale),
    K,
    should_skip_update_fn=skip,
    grad_reduction=reduction,
    axis_name=axis_name,
  )


@functools.cache
def _one_device(reduction):
  """`MultiSteps.update` under `jit` on one device: params, updates applied."""
  opt, loss = _opt(reduction), LOSSES[reduction]

  @jax.jit
  def step(params, state, batch):
    grads, weight = jax.grad(loss, has_aux=True)(params, batch)
    updates, state = opt.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  params, state = PARAMS, opt.init(PARAMS)
  for batch in _micro_batches():
    params, state = step(params, state, batch)
  return jax.device_get(params), int(state.gradient_step)


def test_the_threshold_rejects_some_micro_batches_on_one_device():
  """Else the comparisons below would not tell the gradients apart."""
  for reduction in LOSSES:
    _, updates = _one_device(reduction)
    assert 0 < updates < MICRO_BATCHES // K, reduction


@pytest.mark.parametrize("reduction", sorted(LOSSES))
def test_update_in_shard_map_rejects_what_one_device_rejects(reduction):
  """Each replica passes its rows' gradient and weight, as documented."""
  opt, loss = _opt(reduction, axis_name="data"), LOSSES[reduction]
  mesh = jax.make_mesh((REPLICAS,), ("data",))

  def local(params, state, batch):
    own = jax.lax.pcast(params, "data", to="varying")
    grads, weight = jax.grad(loss, has_aux=True)(own, batch)
    updates, state = opt.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
  )
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  state = opt.init(params)
  for batch in _micro_batches():
    params, state = step(params, state, _rows(batch, mesh))
  want, updates = _one_device(reduction)
  assert int(state.gradient_step) == updates
  np.testing.assert_allclose(params["w"], want["w"], rtol=1e-5, atol=1e-6)


def test_the_train_step_with_axis_name_rejects_what_one_device_rejects():
  mesh = jax.make_mesh((REPLICAS,), ("data",))
  opt = _opt(axis_name="data")
  step = optax_accum.make_train_step(_mean_loss, opt, axis_name="data")
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  state = opt.init(params)
  for batch in _micro_batches():
    params, state, metrics = step(params, state, _rows(batch, mesh))
  want, updates = _one_device("mean")
  assert int(metrics["update_count"]) == updates
  np.testing.assert_allclose(params["w"], want["w"], rtol=1e-5, atol=1e-6)

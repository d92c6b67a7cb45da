"""The train step's programs and ``MultiSteps.update`` keep the types the
maths gives: an inner state typed unlike its param on an Explicit mesh, and
float64 norms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

K = 2


def _loss(params, batch):
  rows = batch["x"].shape[0]
  return ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean(), jnp.asarray(
    rows, params["w"].dtype
  )


def _batches(dtype=np.float32):
  rng = np.random.default_rng(0)
  return [
    {
      "x": rng.normal(size=(8, 8)).astype(dtype),
      "y": rng.normal(size=(8, 4)).astype(dtype),
    }
    for _ in range(K)
  ]


def _momentum_with_replicated_state(lr):
  """A transformation whose ``init`` is ``jnp.zeros(p.shape)``: replicated on
  a mesh, where its ``update`` returns the state split like the param."""

  def init(params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)

  def update(updates, state, params=None):
    del params
    state = jax.tree.map(lambda m, g: 0.9 * m + g, state, updates)
    return jax.tree.map(lambda m: -lr * m, state), state

  return optax.GradientTransformation(init, update)


def _whole_batch(params, batches, inner):
  """One update on the window's gradient (equal micro-batches: the mean)."""
  whole = jax.tree.map(lambda *x: np.concatenate(x), *batches)
  grads = jax.grad(lambda p: _loss(p, whole)[0])(params)
  updates, _ = inner.update(grads, inner.init(params), params)
  return optax.apply_updates(params, updates), grads


def _train_step(opt):
  """The ready-made step, as ``(params, state, batch) -> (params, state)``."""
  step = optax_accum.make_train_step(_loss, opt)
  return lambda params, state, batch: step(params, state, batch)[:2]


def _update_in_jit(opt):
  """``MultiSteps.update`` in the user's own ``jit``."""

  @jax.jit
  def step(params, state, batch):
    grads, rows = jax.grad(_loss, has_aux=True)(params, batch)
    updates, state = opt.update(grads, state, params, weight=rows)
    return optax.apply_updates(params, updates), state

  return step


# The first call cannot reuse the replicated state's buffers for the split
# ones its update returns; JAX says so once.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize(
  "path", [_train_step, _update_in_jit], ids=lambda f: f.__name__
)
def test_inner_state_not_split_like_params_on_an_explicit_mesh(path):
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  inner = _momentum_with_replicated_state(0.1)
  w = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
  want, _ = _whole_batch({"w": w}, _batches(), inner)
  opt = optax_accum.MultiSteps(inner, K)
  step = path(opt)
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(w, NamedSharding(mesh, P(None, "model")))}
    state = opt.init(params)
    for batch in _batches():
      params, state = step(params, state, jax.device_put(batch, P("data")))
  assert int(state.gradient_step) == 1
  np.testing.assert_allclose(params["w"], want["w"], rtol=1e-5, atol=1e-6)


def test_grad_norm_of_float64_params_is_float64_in_both_programs():
  with jax.enable_x64(True):
    params = {"w": np.random.default_rng(2).normal(size=(8, 4))}
    inner = optax.sgd(0.1)
    _, grads = _whole_batch(params, _batches(np.float64), inner)
    opt = optax_accum.MultiSteps(inner, K)
    step = optax_accum.make_train_step(_loss, opt)
    state, norms = opt.init(params), []
    for batch in _batches(np.float64):
      params, state, metrics = step(params, state, batch)
      norms.append(metrics["grad_norm"])
    assert [n.dtype for n in norms] == [jnp.float64, jnp.float64]
    assert float(norms[0]) == 0.0  # Inside the window: no gradient applied.
    want = np.sqrt(np.sum(np.square(np.asarray(grads["w"]))))
    np.testing.assert_allclose(float(norms[1]), want, rtol=1e-12)

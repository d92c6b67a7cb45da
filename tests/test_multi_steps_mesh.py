"""`MultiSteps.update` in the user's own `jit`, params sharded on an Explicit mesh.

Issue 43, item 1: on `jax.make_mesh((4, 2), ("data", "model"))` (Explicit
axes), params split over `model` (tensor parallel) or over `data` (FSDP), the
window-end `cond` failed to trace: its "hold" branch built zeros without the
params' sharding. Here both layouts end where one device does on the whole
batch, and without weights where `optax.MultiSteps` does in the same loop.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, WINDOWS, ROWS = 2, 2, 6
SPECS = {
  "tp": {"w": P(None, "model"), "out": P("model", None)},
  "fsdp": {"w": P("data"), "out": P("data")},
}


def _loss(params, batch):
  """Token-mean squared error of a 2-layer MLP, and its valid rows."""
  hidden = jnp.tanh(jnp.einsum("ri,ih->rh", batch["x"], params["w"], out_sharding=P()))
  pred = jnp.einsum("rh,ho->ro", hidden, params["out"], out_sharding=P())
  error = ((pred - batch["y"]) ** 2).sum(-1) * batch["mask"]
  return error.sum() / jnp.maximum(batch["mask"].sum(), 1.0), batch["mask"].sum()


def _params():
  rng = np.random.default_rng(0)
  return {
    "w": rng.normal(size=(4, 8)).astype(np.float32),
    "out": (rng.normal(size=(8, 2)) / 8**0.5).astype(np.float32),
  }


def _micro_batches():
  """`WINDOWS * K` micro-batches with different numbers of valid rows."""
  rng = np.random.default_rng(1)
  return [
    {
      "x": rng.normal(size=(ROWS, 4)).astype(np.float32),
      "y": rng.normal(size=(ROWS, 2)).astype(np.float32),
      "mask": (np.arange(ROWS) < 1 + 2 * i % ROWS).astype(np.float32),
    }
    for i in range(WINDOWS * K)
  ]


def _adamw():
  return optax.adamw(3e-2, weight_decay=0.1)


@functools.cache
def _mesh():
  return jax.make_mesh((4, 2), ("data", "model"))


@functools.cache
def _one_device():
  return jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def whole():
  """The oracle: AdamW on each window's concatenated micro-batches, one device."""
  mbs = _micro_batches()
  windows = [
    jax.tree.map(lambda *x: np.concatenate(x), *mbs[i * K : (i + 1) * K])
    for i in range(WINDOWS)
  ]
  with jax.set_mesh(_one_device()):
    params, _, _ = toy_lm.whole_batch_run(_params(), windows, _adamw(), _loss)
  return jax.device_get(params)


def _run(layout, opt, weighted):
  """The loop users write: one `jit` per micro-batch, inside `jax.set_mesh`."""
  mesh = _mesh()
  shardings = {n: NamedSharding(mesh, s) for n, s in SPECS[layout].items()}
  params = jax.device_put(_params(), shardings)

  @jax.jit
  def step(params, state, batch):
    grads, weight = jax.grad(_loss, has_aux=True)(params, batch)
    kwargs = {"weight": weight} if weighted else {}
    updates, state = opt.update(grads, state, params, **kwargs)
    return optax.apply_updates(params, updates), state, updates

  with jax.set_mesh(mesh):
    state = jax.jit(opt.init)(params)
    for i, batch in enumerate(_micro_batches()):
      before = params
      params, state, updates = step(params, state, batch)
      for name, sharding in shardings.items():
        placed = updates[name].sharding
        assert placed.is_equivalent_to(sharding, 2), (name, placed)
      if (i + 1) % K:  # Mid-window: params bit-identical.
        jax.tree.map(np.testing.assert_array_equal, params, before)
  return jax.device_get(params)


@pytest.mark.parametrize("layout", sorted(SPECS))
def test_sharded_params_with_weights_match_the_whole_batch(layout, whole):
  params = _run(layout, optax_accum.MultiSteps(_adamw(), K), weighted=True)
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5


@pytest.mark.parametrize("layout", sorted(SPECS))
def test_sharded_params_without_weights_match_optax_multi_steps(layout):
  ours = _run(layout, optax_accum.MultiSteps(_adamw(), K), weighted=False)
  theirs = _run(layout, optax.MultiSteps(_adamw(), K), weighted=False)
  assert toy_lm.max_rel_diff(ours, theirs) <= 1e-6

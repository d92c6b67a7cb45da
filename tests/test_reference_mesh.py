"""The train step and `MultiSteps.update` in your `jit` on a tensor-parallel
4 x 2 Explicit mesh, in float64, against a float64 NumPy reference of the
whole batch (issue 43, item 4).

Params split over `model` (column- then row-parallel), each micro-batch's rows
split over `data`. Every window's params and loss (and the step's gradient
norm) are those of one SGD-with-momentum update on the window's concatenated
micro-batches, written in NumPy from the token-mean loss, to float64 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, WINDOWS, ROWS, WIDTH = 2, 3, 16, 8
LR, MOMENTUM = 0.1, 0.9
SPECS = {"w": P(None, "model"), "out": P("model", None)}
#: Relative error allowed: float64 rounding over a few hundred operations.
TOL = 1e-12


def _loss(params, batch):
  """Token-mean squared error of a 2-layer MLP and its valid rows; the
  row-parallel matmul's result stays with the rows (an Explicit mesh asks)."""
  hidden = jnp.tanh(batch["x"] @ params["w"])
  pred = jnp.einsum("rh,ho->ro", hidden, params["out"], out_sharding=P("data", None))
  error = ((pred - batch["y"]) ** 2).sum(-1) * batch["mask"]
  return error.sum() / batch["mask"].sum(), batch["mask"].sum()


def _reference_grads(params, batch):
  """`_loss` and its gradient, by hand in NumPy (float64)."""
  x, y, mask = batch["x"], batch["y"], batch["mask"]
  hidden = np.tanh(x @ params["w"])
  residual = hidden @ params["out"] - y
  count = mask.sum()
  d_pred = 2 * residual * mask[:, None] / count
  d_hidden = d_pred @ params["out"].T
  grads = {"w": x.T @ (d_hidden * (1 - hidden**2)), "out": hidden.T @ d_pred}
  return (residual**2).sum(-1) @ mask / count, grads


def _params():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(3, WIDTH)), "out": rng.normal(size=(WIDTH, 2)) / 3}


def _micro_batches():
  """Rows longest-valid first: the last devices' rows are often all padding."""
  rng = np.random.default_rng(1)
  out = []
  for _ in range(WINDOWS * K):
    valid = np.sort(rng.random(ROWS))[::-1] < rng.uniform(0.3, 0.9)
    out.append(
      {
        "x": rng.normal(size=(ROWS, 3)),
        "y": rng.normal(size=(ROWS, 2)),
        "mask": valid.astype(np.float64),
      }
    )
  return out


def _reference():
  """Per window: params after it, its loss and its gradient's norm."""
  params = _params()
  momentum = jax.tree.map(np.zeros_like, params)
  mbs, out = _micro_batches(), []
  for i in range(WINDOWS):
    window = {
      n: np.concatenate([mb[n] for mb in mbs[i * K : (i + 1) * K]]) for n in mbs[0]
    }
    loss, grads = _reference_grads(params, window)
    momentum = {n: grads[n] + MOMENTUM * momentum[n] for n in params}
    params = {n: params[n] - LR * momentum[n] for n in params}
    norm = np.sqrt(sum((g**2).sum() for g in grads.values()))
    out.append((params, loss, norm))
  return out


def _rel(got, want):
  return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def _check(got):
  """``got``: per window, params, loss and (for the step) gradient norm."""
  for window, (mine, want) in enumerate(zip(got, _reference(), strict=True)):
    for name, value in mine[0].items():
      assert value.dtype == np.float64, name
      assert _rel(value, want[0][name]) <= TOL, (window, name)
    for value, expected in zip(mine[1:], want[1:], strict=False):
      assert _rel(value, expected) <= TOL, window


def _run(call):
  """``call(params, state, micro_batch)`` over every micro-batch on the mesh,
  in float64; per window, what it returned."""
  with jax.enable_x64(True):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = {
      n: jax.device_put(v, NamedSharding(mesh, SPECS[n])) for n, v in _params().items()
    }
    rows = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
      state = jax.jit(_optimizer().init)(params)
      got = []
      for i, mb in enumerate(_micro_batches()):
        params, state, *rest = call(params, state, jax.device_put(mb, rows))
        if (i + 1) % K == 0:
          got.append((jax.device_get(params), *rest))
  return got


def _optimizer():
  return optax_accum.MultiSteps(optax.sgd(LR, momentum=MOMENTUM), K)


def test_the_train_step_matches_the_reference():
  step = optax_accum.make_train_step(_loss, _optimizer())

  def call(params, state, batch):
    params, state, metrics = step(params, state, batch)
    return params, state, metrics["loss"], metrics["grad_norm"]

  _check(_run(call))


def test_update_in_your_jit_matches_the_reference():
  """`MultiSteps.update` in the user's `jit` (issue 43, item 1), with the
  window's loss passed as `loss=`."""
  opt = _optimizer()

  @jax.jit
  def call(params, state, batch):
    (loss, weight), grads = jax.value_and_grad(_loss, has_aux=True)(params, batch)
    updates, state = opt.update(grads, state, params, weight=weight, loss=loss)
    return optax.apply_updates(params, updates), state, state.last_window_loss

  _check(_run(call))

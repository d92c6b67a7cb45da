"""Params are never taken for a layout (issue 70).

A stored node (``PerReplica``'s ``sums`` and ``axes``, ``Packed``'s ``groups``
and ``rest``) is recognised by its type, and a checkpoint's accumulator by its
tree against the params' own: params whose top-level keys or fields are
exactly a stored node's resume through orbax mid-window, bit-identical to the
uninterrupted run, with ``MultiSteps.update`` (one device, and under ``jit``
on 8) and with the train step on an 8-device ``Explicit`` mesh (per-replica
partial sums).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

K, ROWS = 4, 8


class Named(NamedTuple):
  """Params with a field named as the stored nodes' old description."""

  w: np.ndarray
  describes: np.ndarray


def _leaf(rng, shape):
  return (rng.normal(size=shape) * 0.3).astype(np.float32)


def _params(name):
  rng = np.random.default_rng(0)
  w, b = _leaf(rng, (3, 4)), _leaf(rng, (4,))
  if name == "sums":
    return {"sums": w}
  if name == "sums-axes":
    return {"sums": w, "axes": b}
  if name == "groups-rest":  # 20 leaves of 4x4: once packed in groups of 16.
    return {"groups": [_leaf(rng, (4, 4)) for _ in range(20)], "rest": b}
  return Named(w, b)


NAMES = ["sums", "sums-axes", "groups-rest", "describes"]


def _loss(params, batch):
  pred = sum(
    jnp.tanh(batch["x"] @ p.reshape(4, -1)).sum(-1) for p in jax.tree.leaves(params)
  )
  n = batch["mask"].sum()
  return (((pred - batch["y"]) ** 2) * batch["mask"]).sum() / n, n


@functools.cache
def _stream():
  rng = np.random.default_rng(1)
  return tuple(
    {
      "x": rng.normal(size=(ROWS, 4)).astype(np.float32),
      "y": rng.normal(size=ROWS).astype(np.float32),
      "mask": (rng.random(ROWS) < 0.7).astype(np.float32),
    }
    for _ in range(2 * K)
  )


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _placers(devices):
  """``(place_params, place_batch)`` on one device or an 8-device mesh."""
  if devices == 1:
    put = functools.partial(jax.device_put, device=jax.devices()[0])
    return put, put
  mesh = _mesh()
  return (
    lambda t: jax.device_put(t, NamedSharding(mesh, P())),
    lambda t: jax.device_put(t, NamedSharding(mesh, P("data"))),
  )


def _opt():
  return optax_accum.MultiSteps(optax.adam(3e-2), K)


@functools.cache
def _update():
  opt = _opt()

  @jax.jit
  def update(params, state, batch):
    (_, n), grads = jax.value_and_grad(_loss, has_aux=True)(params, batch)
    updates, state = opt.update(grads, state, params, weight=n)
    return optax.apply_updates(params, updates), state

  return update


@functools.cache
def _step():
  return optax_accum.make_train_step(_loss, _opt())


def _run(path, devices, params, state, batches):
  _, place_batch = _placers(devices)
  for batch in batches:
    batch = place_batch(batch)
    if path == "update":
      params, state = _update()(params, state, batch)
    else:
      params, state, _ = _step()(params, state, batch)
  return params, state


def _init(path, params):
  return _opt().init(params) if path == "update" else _step().init(params)


@pytest.mark.parametrize(
  ("path", "devices"),
  [("update", 1), ("update", 8), ("step", 8)],
  ids=["update-1", "update-8", "step-8"],
)
@pytest.mark.parametrize("name", NAMES)
def test_params_named_as_a_node_resume_mid_window_bit_identical(
  name, path, devices, tmp_path
):
  if jax.device_count() < devices:
    pytest.skip("needs 8 devices")
  place_params, _ = _placers(devices)
  params = place_params(_params(name))
  state = _init(path, params)
  stream = _stream()
  whole, _ = _run(path, devices, params, state, stream)
  params = place_params(_params(name))
  params, state = _run(path, devices, params, _init(path, params), stream[:2])
  assert int(state.mini_step) == 2
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "c", {"params": params, "opt_state": state})
  ckpt.wait_until_finished()
  saved = ckpt.metadata(tmp_path / "c").item_metadata["opt_state"]
  fresh = place_params(jax.tree.map(np.zeros_like, _params(name)))
  # Against opt.init's one sum (what MultiSteps.update resumes from) and,
  # for the step, against its own init.
  starts = [_opt().init(fresh)] + ([_step().init(fresh)] if path == "step" else [])
  for start in starts:
    target = optax_accum.resume_target(start, saved)
    if path == "update":  # Restored where the user's own jit takes it.
      target = place_params(target)
    assert type(target.acc_grads) is type(state.acc_grads)
    shapes = [np.shape(x) for x in jax.tree.leaves(state)]
    assert [np.shape(x) for x in jax.tree.leaves(target)] == shapes
    restored = ckpt.restore(tmp_path / "c", {"params": fresh, "opt_state": target})
    resumed, _ = _run(
      path, devices, restored["params"], restored["opt_state"], stream[2:]
    )
    jax.tree.map(np.testing.assert_array_equal, resumed, whole)


@pytest.mark.parametrize("name", NAMES)
def test_multi_steps_takes_its_own_init_whatever_the_params_fields(name):
  """``opt.init``'s one sum is one sum under ``jit``, whatever the params'
  fields are named; a stored node is still refused, by its type."""
  params = _params(name)
  opt = _opt()
  state = opt.init(params)
  grads = jax.tree.map(np.ones_like, params)
  _, state = jax.jit(lambda g, s: opt.update(g, s, weight=1.0))(grads, state)
  assert int(state.mini_step) == 1
  node = optax_accum.PerReplica(jax.tree.map(lambda p: p[None], params), ())
  with pytest.raises(ValueError, match=r"per-replica partial sums.*relayout"):
    opt.update(grads, state._replace(acc_grads=node), weight=1.0)

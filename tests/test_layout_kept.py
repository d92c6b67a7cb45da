"""Layouts are kept (issue 70): a state's layout is decided once and changes
only through ``relayout``.

On an 8-device ``Explicit`` mesh, where ``step.init`` keeps per-replica
partial sums, ``opt.init(params)``'s one sum stays one sum through streamed
micro-steps, a window end, an early ``end_window`` and scan windows, and an
orbax restore against ``opt.init(fresh)`` resumes bit-identical.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, ROWS = 4, 16


def _loss(params, batch):
  pred = jnp.tanh(batch["x"] @ params["w"]).sum(-1) + params["b"].sum()
  n = batch["mask"].sum()
  return (((pred - batch["y"]) ** 2) * batch["mask"]).sum() / n, n


@functools.cache
def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _params():
  rng = np.random.default_rng(0)
  params = {
    "w": rng.normal(size=(3, 4)).astype(np.float32),
    "b": rng.normal(size=4).astype(np.float32),
  }
  return jax.device_put(params, NamedSharding(_mesh(), P()))


@functools.cache
def _stream():
  rng = np.random.default_rng(1)
  return tuple(
    {
      "x": rng.normal(size=(ROWS, 3)).astype(np.float32),
      "y": rng.normal(size=ROWS).astype(np.float32),
      "mask": (rng.random(ROWS) < 0.7).astype(np.float32),
    }
    for _ in range(3 * K)
  )


def _opt():
  return optax_accum.MultiSteps(optax.adamw(3e-2), K)


@functools.cache
def _step(mode):
  return optax_accum.make_train_step(_loss, _opt(), mode=mode)


def _stream_run(params, state, batches, one_sum=True):
  put = functools.partial(jax.device_put, device=NamedSharding(_mesh(), P("data")))
  for batch in batches:
    params, state, _ = _step("stream")(params, state, put(batch))
    if one_sum:
      assert jax.tree.structure(state) == jax.tree.structure(_opt().init(params))
  return params, state


def test_step_init_keeps_per_replica_partial_sums_here():
  """The mesh is one where the step's own init chooses partial sums."""
  params = _params()
  assert isinstance(_step("stream").init(params).acc_grads, optax_accum.PerReplica)


def test_one_sum_stays_one_sum_streamed_at_window_ends_and_in_scan():
  params = _params()
  state = _opt().init(params)
  params, state = _stream_run(params, state, _stream()[: K + 2])  # Ends one.
  assert int(state.mini_step) == 2 and int(state.gradient_step) == 1
  put = NamedSharding(_mesh(), P("data"))
  early = jax.device_put(_stream()[K + 2], put)
  params, state, metrics = _step("stream")(params, state, early, end_window=True)
  assert bool(metrics["updated"]) and int(state.mini_step) == 0
  assert jax.tree.structure(state) == jax.tree.structure(_opt().init(params))
  window = jax.tree.map(lambda *x: np.stack(x), *_stream()[:K])
  window = jax.device_put(window, NamedSharding(_mesh(), P(None, "data")))
  for _ in range(2):  # The scan step, given the one sum, returns one sum.
    params, state, _ = _step("scan")(params, state, window)
    assert jax.tree.structure(state) == jax.tree.structure(_opt().init(params))
  params, state = _stream_run(params, state, _stream()[:2])
  assert jax.tree.structure(state) == jax.tree.structure(_opt().init(params))


def test_one_sum_restores_against_opt_init_and_resumes_bit_identical(tmp_path):
  whole, _ = _stream_run(_params(), _opt().init(_params()), _stream()[: 2 * K])
  params, state = _stream_run(_params(), _opt().init(_params()), _stream()[:2])
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "c", {"params": params, "opt_state": state})
  ckpt.wait_until_finished()
  fresh = jax.tree.map(jnp.zeros_like, _params())
  target = {"params": fresh, "opt_state": _opt().init(fresh)}
  restored = ckpt.restore(tmp_path / "c", target)
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
  resumed, _ = _stream_run(
    restored["params"], restored["opt_state"], _stream()[2 : 2 * K]
  )
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)


def test_relayout_is_the_one_way_to_another_layout():
  """``relayout`` to ``step.init``'s layout gives partial sums, which the step
  keeps from then on."""
  params, state = _stream_run(_params(), _opt().init(_params()), _stream()[:2])
  state = optax_accum.relayout(state, _step("stream").init(_params()))
  assert isinstance(state.acc_grads, optax_accum.PerReplica)
  _, state = _stream_run(params, state, _stream()[2 : K + 2], one_sum=False)
  assert isinstance(state.acc_grads, optax_accum.PerReplica)

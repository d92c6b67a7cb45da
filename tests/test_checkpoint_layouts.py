"""Orbax checkpoints of every data-parallel recipe resume on any device count.

Issue 25, item 3: the `axis_name` step under plain `jit` keeps one partial
sum per replica (a leading axis of replicas), so restoring against
`opt.init(params)` failed on the shape. Since item 1 the plain `jit` step
keeps them too on an Explicit mesh. Each test saves on 8 devices in the
middle of a window or at its end, restores with the `restore` function of
docs/checkpointing.md (read from the page, so the tested recipe is the
documented one) and resumes: bit-identical on the layout that saved it,
within 1e-6 of the uninterrupted run on 4 devices and on one.
"""

import functools
import pathlib

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import toy_lm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from markdown_examples import documented_function

import optax_accum

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, WINDOWS, ROWS, LENGTH = 4, 2, 8, 5
PAGE = pathlib.Path(__file__).parent.parent / "docs" / "checkpointing.md"


def _docs_restore():
  """`restore(path, params, opt)` as docs/checkpointing.md defines it."""
  return documented_function(PAGE, "restore")


def _loss(params, batch):
  logits = batch["x"] @ params["w"] + params["b"][None, None, :]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return (nll * batch["mask"]).sum() / batch["mask"].sum(), batch["mask"].sum()


def _stream():
  """The run's micro-batches in order; the rows of each split 8 ways hold
  very different numbers of tokens."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(K * WINDOWS):
    lengths = np.sort(rng.integers(1, LENGTH + 1, ROWS))[::-1]
    out.append(
      {
        "x": rng.normal(size=(ROWS, LENGTH, 3)).astype(np.float32),
        "y": rng.integers(0, 4, (ROWS, LENGTH)),
        "mask": (np.arange(LENGTH) < lengths[:, None]).astype(np.float32),
      }
    )
  return out


def _params0():
  rng = np.random.default_rng(1)
  return {
    "w": rng.normal(size=(3, 4)).astype(np.float32),
    "b": np.zeros(4, np.float32),
  }


OPT = optax_accum.MultiSteps(optax.adamw(3e-2, weight_decay=0.1), K)


@functools.cache
def _layout(name):
  """``(place_params, place_batch, step)`` for one way to run.

  "jit", "axis_name", "shard_map": the three data-parallel recipes on 8
  devices; "axis_name-4", "axis_name-1": `axis_name` under jit on 4 devices
  and on a 1-device mesh; "one-device": no mesh, no `axis_name`.
  """
  if name == "one-device":
    device = jax.devices()[0]
    step = optax_accum.make_train_step(_loss, OPT)
    return (lambda t: jax.device_put(t, device)), (lambda t: t), step
  size = {"axis_name-4": 4, "axis_name-1": 1}.get(name, 8)
  mesh = jax.make_mesh((size,), ("data",), devices=jax.devices()[:size])
  axis_name = None if name == "jit" else "data"
  step = optax_accum.make_train_step(_loss, OPT, axis_name=axis_name)
  if name == "shard_map":
    step = jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())
      )
    )

  def place(tree, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))

  return (lambda t: place(t, P())), (lambda t: place(t, P("data"))), step


def _run(name, params, state, micro_batches):
  place_params, place_batch, step = _layout(name)
  if params is None:
    params = place_params(_params0())
    state = OPT.init(params)
  for micro_batch in micro_batches:
    params, state, _ = step(params, state, place_batch(micro_batch))
  return params, state


@functools.cache
def _uninterrupted(name):
  params, state = _run(name, None, None, _stream())
  assert int(state.gradient_step) == WINDOWS
  return jax.device_get(params)


@pytest.mark.parametrize("position", [2, K], ids=["mid-window", "window-end"])
@pytest.mark.parametrize("saved_by", ["jit", "axis_name", "shard_map"])
def test_checkpoint_resumes_on_every_layout(saved_by, position, tmp_path):
  params, state = _run(saved_by, None, None, _stream()[:position])
  assert int(state.mini_step) == position % K
  path = tmp_path / "checkpoint"
  saver = ocp.StandardCheckpointer()
  saver.save(path, {"params": params, "opt_state": state, "position": position})
  saver.wait_until_finished()
  acc_shape = saver.metadata(path).item_metadata["opt_state"]["acc_grads"]["w"].shape
  # Under jit on jax.make_mesh's Explicit mesh, with `axis_name` or without,
  # each device keeps its own partial sum: a leading axis of replicas.
  assert acc_shape == ((3, 4) if saved_by == "shard_map" else (8, 3, 4))

  restore = _docs_restore()
  uninterrupted = _uninterrupted(saved_by)
  for name in (saved_by, "axis_name-4", "axis_name-1", "one-device"):
    place_params = _layout(name)[0]
    fresh = place_params(jax.tree.map(np.zeros_like, _params0()))
    restored = restore(path, fresh, OPT)
    assert int(restored["position"]) == position
    params, state = _run(
      name, restored["params"], restored["opt_state"], _stream()[position:]
    )
    assert int(state.gradient_step) == WINDOWS, name
    resumed = jax.device_get(params)
    if name == saved_by:
      jax.tree.map(np.testing.assert_array_equal, resumed, uninterrupted)
    else:
      assert toy_lm.max_rel_diff(resumed, uninterrupted) <= 1e-6, name

"""Checkpoints written by optax_accum 0.1.0, and by the train step's packed
layout before packing was removed, restore with the documented recipes.

``tests/data/checkpoints-0.1.0`` holds orbax checkpoints of the run in
``checkpoint_worker`` saved by release 0.1.0 (``make.py`` beside them), mid-window
and at a window boundary, and the params of the uninterrupted run.

On the machine that saved them the resumed run was bit-identical to the
uninterrupted one. XLA:CPU compiles for the CPU it runs on (AVX2 or AVX-512
code, fused multiply-adds or not), so elsewhere the last bits differ: 5e-7
relative, after 2 AdamW updates, on an AVX-512 EPYC against the recording
machine. Bit-identical resumption on one machine is `test_checkpoint.py`'s.
"""

import importlib.util
import pathlib

import checkpoint_worker as worker
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import toy_lm

import optax_accum

#: Float32 rounding after two AdamW updates (seen: 5.1e-7 relative, 2.8e-9 absolute).
RTOL, ATOL = 4e-6, 1e-9

SAVED = pathlib.Path(__file__).parent / "data" / "checkpoints-0.1.0"
PACKED = pathlib.Path(__file__).parent / "data" / "checkpoints-packed"


@pytest.mark.parametrize("position", [2, 4])
def test_a_release_0_1_0_checkpoint_resumes_the_recorded_run(position):
  opt, step = worker.make()
  fresh = toy_lm.init_params(seed=0)
  target = {"params": fresh, "opt_state": opt.init(fresh), "position": 0}
  restored = ocp.StandardCheckpointer().restore(
    (SAVED / f"position-{position}").absolute(), target
  )
  assert int(restored["position"]) == position
  params, state = restored["params"], restored["opt_state"]
  assert int(state.mini_step) == position % worker.K
  for micro_batch in worker.stream()[position:]:
    params, state, _ = step(params, state, micro_batch)
  uninterrupted = np.load(SAVED / "uninterrupted.npz")
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    np.testing.assert_allclose(
      np.asarray(leaf), uninterrupted[jax.tree_util.keystr(path)], RTOL, ATOL
    )


def _packed_run():
  """``make_packed.py`` beside the packed checkpoint: its model, stream and step."""
  spec = importlib.util.spec_from_file_location("packed_run", PACKED / "make_packed.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.full_optimization
@pytest.mark.parametrize("convert", ["step", "relayout"])
def test_a_packed_checkpoint_resumes_as_one_sum(convert):
  """A mid-window checkpoint of ``step.init``'s packed sums (20 leaves of 4x4
  in one buffer) restores against ``resume_target``'s target; the step's first
  call, or ``relayout`` to ``opt.init``'s layout, makes it one sum, and the
  run ends where the uninterrupted one-sum run did (bit for bit on the
  recording machine: unpacking is exact and the adds are in the same order)."""
  run = _packed_run()
  opt, step = run.make()
  fresh = run.init_params()
  path = (PACKED / "position-2").absolute()
  ckpt = ocp.StandardCheckpointer()
  saved = ckpt.metadata(path).item_metadata["opt_state"]
  target = optax_accum.resume_target(opt.init(fresh), saved)
  restored = ckpt.restore(path, {"params": fresh, "opt_state": target, "position": 0})
  params, state = restored["params"], restored["opt_state"]
  assert isinstance(state.acc_grads, optax_accum.Packed)
  assert int(state.mini_step) == 2
  if convert == "relayout":
    state = optax_accum.relayout(state, opt.init(params))
    assert jax.tree.structure(state) == jax.tree.structure(opt.init(params))
  for micro_batch in run.stream()[int(restored["position"]) :]:
    params, state, _ = step(params, state, micro_batch)
  assert jax.tree.structure(state.acc_grads) == jax.tree.structure(params)
  uninterrupted = np.load(PACKED / "uninterrupted.npz")
  for name, leaf in params.items():
    np.testing.assert_allclose(np.asarray(leaf), uninterrupted[name], RTOL, ATOL)


def test_a_packed_checkpoint_of_other_params_is_refused():
  run = _packed_run()
  opt, _ = run.make()
  fewer = dict(list(run.init_params().items())[:10])
  saved = (
    ocp.StandardCheckpointer()
    .metadata((PACKED / "position-2").absolute())
    .item_metadata["opt_state"]
  )
  with pytest.raises(ValueError, match=r"packed in groups of \[320\] elements"):
    optax_accum.resume_target(opt.init(fewer), saved)


def test_multi_steps_update_names_relayout_for_a_packed_state():
  """``MultiSteps.update`` takes one sum: a restored packed state is refused,
  naming the converter; after ``relayout`` it adds as the one sum would."""
  run = _packed_run()
  opt, _ = run.make()
  params = run.init_params()
  saved = (
    ocp.StandardCheckpointer()
    .metadata((PACKED / "position-2").absolute())
    .item_metadata["opt_state"]
  )
  packed = optax_accum.resume_target(opt.init(params), saved)
  grads = jax.tree.map(np.ones_like, params)
  with pytest.raises(ValueError, match=r"optax_accum\.relayout"):
    opt.update(grads, packed, params)
  _, state = opt.update(grads, optax_accum.relayout(packed, opt.init(params)), params)
  assert int(state.mini_step) == 1

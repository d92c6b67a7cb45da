"""Checkpoints written by optax_accum 0.1.0 restore with the documented recipe.

``tests/data/checkpoints-0.1.0`` holds orbax checkpoints of the run in
``checkpoint_worker`` saved by release 0.1.0 (``make.py`` beside them), mid-window
and at a window boundary, and the params of the uninterrupted run.

On the machine that saved them the resumed run was bit-identical to the
uninterrupted one. XLA:CPU compiles for the CPU it runs on (AVX2 or AVX-512
code, fused multiply-adds or not), so elsewhere the last bits differ: 5e-7
relative, after 2 AdamW updates, on an AVX-512 EPYC against the recording
machine. Bit-identical resumption on one machine is `test_checkpoint.py`'s.
"""

import pathlib

import checkpoint_worker as worker
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import toy_lm

#: Float32 rounding after two AdamW updates (seen: 5.1e-7 relative, 2.8e-9 absolute).
RTOL, ATOL = 4e-6, 1e-9

SAVED = pathlib.Path(__file__).parent / "data" / "checkpoints-0.1.0"


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

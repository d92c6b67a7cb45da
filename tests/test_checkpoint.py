"""A half-full accumulation window survives an orbax checkpoint and a new process."""

import pathlib
import subprocess
import sys

import checkpoint_worker as worker
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import toy_lm


@pytest.mark.slow
def test_resume_mid_window_in_a_fresh_process_is_bit_identical(tmp_path):
  stream = worker.stream()
  opt, step = worker.make()

  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  for micro_batch in stream:  # The uninterrupted run.
    params, state, _ = step(params, state, micro_batch)
  assert int(state.gradient_step) == worker.WINDOWS
  uninterrupted = params

  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  for micro_batch in stream[:2]:  # 2 of the first window's 4 micro-batches.
    params, state, _ = step(params, state, micro_batch)
  assert int(state.mini_step) == 2 and float(state.acc_weight) > 0
  # Control: resuming without the half-full window gives other params.
  lost, lost_state = params, opt.init(params)
  for micro_batch in stream[2:]:
    lost, lost_state, _ = step(jax.tree.map(np.copy, lost), lost_state, micro_batch)
  assert toy_lm.max_rel_diff(lost, uninterrupted) > 1e-3
  checkpoint = tmp_path / "checkpoint"
  saver = ocp.StandardCheckpointer()
  saver.save(checkpoint, {"params": params, "opt_state": state, "position": 2})
  saver.wait_until_finished()

  out = tmp_path / "resumed.npz"
  worker_path = pathlib.Path(worker.__file__)
  done = subprocess.run(
    [sys.executable, str(worker_path), str(checkpoint), str(out)],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  saved = np.load(out)
  for path, leaf in jax.tree_util.tree_leaves_with_path(uninterrupted):
    np.testing.assert_array_equal(saved[jax.tree_util.keystr(path)], np.asarray(leaf))

"""Resumes a run from an orbax checkpoint, in a fresh process.

Usage: python checkpoint_worker.py CHECKPOINT_DIR OUT.npz. Used by
`test_checkpoint.py`: the checkpoint holds params, the optimizer state (a
half-full accumulation window) and the data position.
"""

import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import toy_lm

import optax_accum

K, WINDOWS = 4, 2


def stream():
  """The run's micro-batches, in order: the data position indexes this list."""
  return [
    mb for w in range(WINDOWS) for mb in toy_lm.split(toy_lm.make_batch(seed=w), K)
  ]


def make():
  opt = optax_accum.MultiSteps(toy_lm.adamw_with_schedule(), K)
  return opt, optax_accum.make_train_step(toy_lm.mean_loss, opt)


def main(checkpoint: str, out: str) -> None:
  opt, step = make()
  fresh = toy_lm.init_params(seed=0)
  target = {"params": fresh, "opt_state": opt.init(fresh), "position": 0}
  restored = ocp.StandardCheckpointer().restore(checkpoint, target)
  params, state = restored["params"], restored["opt_state"]
  for micro_batch in stream()[int(restored["position"]) :]:
    params, state, _ = step(params, state, micro_batch)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  np.savez(out, **{jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves})


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])

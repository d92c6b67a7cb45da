"""Saved these checkpoints with optax_accum 0.1.0 (commit 488abc4), before the
layering change: ``cd tests && PYTHONPATH=. python data/checkpoints-0.1.0/make.py
data/checkpoints-0.1.0``. Kept as the record of how they were made."""

import pathlib
import sys

import checkpoint_worker as worker
import jax
import numpy as np
import orbax.checkpoint as ocp
import toy_lm


def main(out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  opt, step = worker.make()
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  for position, micro_batch in enumerate(worker.stream()):
    if position in (2, 4):  # Mid-window and at a window boundary.
      ckpt = ocp.StandardCheckpointer()
      saved = {"params": params, "opt_state": state, "position": position}
      ckpt.save((out / f"position-{position}").absolute(), saved)
      ckpt.wait_until_finished()
    params, state, _ = step(params, state, micro_batch)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  arrays = {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}
  np.savez(out / "uninterrupted.npz", **arrays)


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))

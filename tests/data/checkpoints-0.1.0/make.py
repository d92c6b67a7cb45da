"""Saves checkpoints with optax_accum 0.1.0 (before the layering change)."""

import pathlib
import sys

import checkpoint_worker as worker
import jax
import numpy as np
import orbax.checkpoint as ocp
import toy_lm

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
stream = worker.stream()
opt, step = worker.make()
params = toy_lm.init_params(seed=0)
state = opt.init(params)
for position, mb in enumerate(stream):
  if position in (2, 4):  # mid-window and at a window boundary
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(
      (out / f"position-{position}").absolute(),
      {"params": params, "opt_state": state, "position": position},
    )
    ckpt.wait_until_finished()
  params, state, _ = step(params, state, mb)
leaves = jax.tree_util.tree_leaves_with_path(params)
np.savez(
  out / "uninterrupted.npz",
  **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves},
)
print(state.gradient_step, state.mini_step)

"""Saved these checkpoints with the train step's packed layout (``step.init``
on one CPU device packed 20 leaves of 4x4 into one buffer), before packing was
removed: ``cd tests && PYTHONPATH=. python data/checkpoints-packed/make_packed.py
data/checkpoints-packed``. ``test_legacy_checkpoints.py`` imports the model and
the stream from here; ``uninterrupted.npz`` holds the params after both windows
of the run from ``opt.init`` (one sum), computed with the same code."""

import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

K, WINDOWS, LEAVES = 4, 2, 20


def init_params() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    f"w{i:02d}": (rng.standard_normal((4, 4)) * 0.5).astype(np.float32)
    for i in range(LEAVES)
  }


def loss_fn(params, batch):
  h = batch["x"]
  for name in sorted(params):
    h = jnp.tanh(h @ params[name])
  return jnp.mean((h - batch["y"]) ** 2), jnp.float32(batch["x"].shape[0])


def stream() -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(1)
  return [
    {
      "x": rng.standard_normal((2, 4)).astype(np.float32),
      "y": rng.standard_normal((2, 4)).astype(np.float32),
    }
    for _ in range(K * WINDOWS)
  ]


def make():
  opt = optax_accum.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), K)
  return opt, optax_accum.make_train_step(loss_fn, opt)


def main(out: pathlib.Path) -> None:
  import orbax.checkpoint as ocp

  out.mkdir(parents=True, exist_ok=True)
  opt, step = make()
  params = init_params()
  state = step.init(params)
  assert isinstance(state.acc_grads, optax_accum.Packed)
  for position, micro_batch in enumerate(stream()):
    if position == 2:  # Mid-window: the packed sums of two micro-batches.
      ckpt = ocp.StandardCheckpointer()
      saved = {"params": params, "opt_state": state, "position": position}
      ckpt.save((out / f"position-{position}").absolute(), saved)
      ckpt.wait_until_finished()
    params, state, _ = step(params, state, micro_batch)
  assert isinstance(state.acc_grads, optax_accum.Packed)
  packed_run = params
  params, state = init_params(), opt.init(init_params())
  for micro_batch in stream():
    params, state, _ = step(params, state, micro_batch)
  assert isinstance(state.acc_grads, dict)
  for name in params:  # Same arithmetic in both layouts.
    np.testing.assert_array_equal(np.asarray(params[name]), packed_run[name])
  np.savez(out / "uninterrupted.npz", **{n: np.asarray(v) for n, v in params.items()})


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))

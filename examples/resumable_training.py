"""A training loop that survives being killed at any moment (SIGKILL included).

The recipe: checkpoint these three things together, in one checkpoint, and
restore them together:

1. the params;
2. the whole optimizer state, which with gradient accumulation holds the
   half-full window (the weighted gradient sum, its token count and the
   micro-step counter) as well as the inner optimizer's moments and counts;
3. the data position: how many micro-batches went into 1 and 2.

Saving any of them alone, or at different moments, loses micro-batches or
counts them twice. Saved together, a checkpoint in the middle of a window is
as good as one at its end: the restarted run redoes the micro-batches after
the checkpoint and ends bit-identical to a run that was never interrupted.
The data must be reproducible from its position: here micro-batch ``i`` is
drawn from ``(seed, i)``; with a real loader, checkpoint its state instead.

``seen`` counts how often each micro-batch was added to the optimizer state.
It lives in the checkpoint next to the accumulator, so after any number of
kills and restarts it must be all ones. Saves are synchronous: a save must not
overlap the next step, which donates (reuses) the params' and state's buffers.
Orbax writes each checkpoint to a temporary directory and renames it when
complete, so a kill during a save leaves the previous checkpoint as the latest.

Run: python examples/resumable_training.py --workdir /tmp/run --out final.npz
(kill it, run the same command again: it resumes).
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_accum

VOCAB, WIDTH, ROWS, SEQ_LEN = 16, 8, 4, 12


def micro_batch(i: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Micro-batch ``i`` of the stream: padded sequences of random lengths."""
  rng = np.random.default_rng((seed, i))
  tokens = rng.integers(0, VOCAB, size=(ROWS, SEQ_LEN + 1))
  lengths = rng.integers(1, SEQ_LEN + 1, size=(ROWS, 1))
  mask = (np.arange(SEQ_LEN) < lengths).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def init_params(seed: int = 0) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
    "embed": jax.random.normal(k1, (VOCAB, WIDTH)),
    "head": jax.random.normal(k2, (WIDTH, VOCAB)) / WIDTH**0.5,
  }


def loss_fn(params, batch):
  """Token-mean next-token loss and the number of valid tokens."""
  logits = jnp.tanh(params["embed"][batch["inputs"]]) @ params["head"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  tokens = batch["mask"].sum()
  return (nll * batch["mask"]).sum() / tokens, tokens


def make_optimizer(total: int, k: int) -> optax_accum.MultiSteps:
  """AdamW, one update per ``k`` micro-batches, its schedule counting updates."""
  updates = (total + k - 1) // k  # The last window may be partial.
  schedule = optax.cosine_decay_schedule(3e-2, decay_steps=updates)
  return optax_accum.MultiSteps(optax.adamw(schedule), every_k_schedule=k)


def fresh_state(opt: optax_accum.MultiSteps, total: int) -> dict:
  """Everything that is checkpointed, as a run starts: also the restore target."""
  params = init_params()
  return {
    "params": params,
    "opt_state": opt.init(params),  # includes the accumulation window
    "position": 0,  # micro-batches already in params and opt_state
    "seen": np.zeros(total, np.int32),  # times each was added to opt_state
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="checkpoints and train.log")
  parser.add_argument("--out", required=True, help=".npz for final params, seen")
  parser.add_argument("--sleep", type=float, default=0.0, help="s per micro-batch")
  parser.add_argument("--micro-batches", type=int, default=24)
  parser.add_argument("--k", type=int, default=4, help="micro-batches per update")
  parser.add_argument("--checkpoint-every", type=int, default=5)
  args = parser.parse_args()
  total, every = args.micro_batches, args.checkpoint_every
  opt = make_optimizer(total, args.k)
  step = optax_accum.make_train_step(loss_fn, opt)

  workdir = os.path.abspath(args.workdir)
  manager = ocp.CheckpointManager(
    os.path.join(workdir, "checkpoints"),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=2,
      # Every n-th micro-batch only (the default also saves the first call).
      save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(every),
      enable_async_checkpointing=False,
    ),
  )
  with open(os.path.join(workdir, "train.log"), "a", buffering=1) as log_file:

    def log(message: str) -> None:
      log_file.write(f"attempt {os.getpid()}: {message}\n")

    state = fresh_state(opt, total)
    if manager.latest_step() is None:
      log("started at micro-batch 0, no checkpoint")
    else:  # The fresh state is the target: it gives structure, dtypes, devices.
      target = ocp.args.StandardRestore(state)
      state = manager.restore(manager.latest_step(), args=target)
      log(f"resumed at micro-batch {int(state['position'])}")
    params, opt_state = state["params"], state["opt_state"]
    seen = np.array(state["seen"])

    for i in range(int(state["position"]), total):
      last = i == total - 1  # A last, partial window still gets its update.
      params, opt_state, metrics = step(
        params, opt_state, micro_batch(i), end_window=last
      )
      seen[i] += 1  # With the add: no checkpoint can hold one without the other.
      log(f"micro-batch {i} added, window loss {float(metrics['loss']):.4f}")
      state = {"params": params, "opt_state": opt_state, "position": i + 1}
      if manager.save(i + 1, args=ocp.args.StandardSave(state | {"seen": seen})):
        log(f"checkpoint at micro-batch {i + 1}")
      time.sleep(args.sleep)

    manager.close()
    final = {f"params/{name}": np.asarray(value) for name, value in params.items()}
    np.savez(args.out, seen=seen, **final)
    log(f"done, {int(optax_accum.get_update_count(opt_state))} updates")


if __name__ == "__main__":
  main()

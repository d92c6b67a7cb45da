"""One of the two processes that `test_multihost.py` starts.

Usage: python multihost_worker.py PORT PROCESS_ID OUT.npz RECIPE. Each
process owns 2 CPU devices and feeds only its own half of every micro-batch;
process 0 writes the final params. RECIPE: "auto" (plain jit on an Auto mesh:
XLA reduces every micro-batch's gradient), "axis_name" (per-replica partial
sums, one reduction per window) or "explicit" (plain jit on the Explicit mesh
`jax.make_mesh` makes: the loss sees the global batch, and the gradient
stays each device's partial sum until the window ends).
"""

import contextlib
import functools
import sys

import jax
import numpy as np
import toy_lm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

K, UPDATES = 2, 5


def main(port: str, process_id: int, out: str, recipe: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
  )
  assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
  auto = (jax.sharding.AxisType.Auto,) if recipe != "explicit" else None
  mesh = jax.make_mesh((4,), ("data",), axis_types=auto)
  data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

  def own_half(micro_batch):
    """This process's rows of a micro-batch, assembled into one global array."""
    half = len(micro_batch["mask"]) // 2
    rows = slice(process_id * half, (process_id + 1) * half)
    local = {name: value[rows] for name, value in micro_batch.items()}
    return jax.make_array_from_process_local_data(data, local)

  params = jax.tree.map(
    lambda x: jax.make_array_from_callback(
      x.shape, replicated, lambda idx: np.asarray(x)[idx]
    ),
    toy_lm.init_params(seed=0),
  )
  opt = optax_accum.MultiSteps(toy_lm.adamw_with_schedule(), K)
  state = jax.jit(opt.init, out_shardings=replicated)(params)
  loss_fn = toy_lm.mean_loss
  if recipe == "explicit":  # The lookup's rows stay where the token ids are.
    loss_fn = functools.partial(loss_fn, rows=P("data", None, None))
  axis_name = "data" if recipe == "axis_name" else None
  step = optax_accum.make_train_step(loss_fn, opt, axis_name=axis_name)
  explicit = recipe == "explicit"
  with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
    if explicit:  # The step's partial sums (it keeps opt.init's one sum).
      state = optax_accum.relayout(state, step.init(params))
    for update in range(UPDATES):
      batch = toy_lm.make_batch(seed=100 + update, batch=32)
      for micro_batch in toy_lm.split(batch, K):
        params, state, metrics = step(params, state, own_half(micro_batch))
        tokens, updated = float(metrics["weight"]), bool(metrics["updated"])
        print(f"process {process_id}: tokens {tokens} updated {updated}", flush=True)
  if explicit:  # Each device's partial sum: a leading axis of replicas.
    sums = state.acc_grads.sums
    assert sums["head"]["w"].shape[0] == 4, sums["head"]["w"].shape

  if process_id == 0:
    local = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), params)
    leaves = jax.tree_util.tree_leaves_with_path(local)
    np.savez(out, **{jax.tree_util.keystr(path): value for path, value in leaves})
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])

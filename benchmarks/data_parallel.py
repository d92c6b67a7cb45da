"""Gradient bytes reduced per window, data parallel on 8 simulated devices.

Run with ``python -m benchmarks.data_parallel`` (``make bench`` runs it after
``benchmarks.accumulation``). For each recipe of the README's data-parallel
section and each ``k``, on an MLP regressor whose batch is split over 8 CPU
devices of a mesh as ``jax.make_mesh`` makes it (Explicit axes; "Auto mesh":
the axis Auto, jax's default before 0.7):

- the bytes all collectives move per window, read from the compiled programs'
  HLO (deterministic): a streaming window runs the accumulate program ``k - 1``
  times and the update program once (traced inside ``shard_map`` the update
  program runs on every micro-step); a scan window runs its loop body ``k``
  times. Shown as a multiple of the params' bytes: 1.0 is one reduction;
- the wall time of a window, timed as loops run: rounds of queued windows with
  one block per round, recipes interleaved, medians.

Results go to ``benchmarks/results/<machine>-data-parallel.{json,md}``.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  )

import argparse
import json
import pathlib
import platform
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from benchmarks.accumulation import RESULTS, Rounds, mlp
from benchmarks.hlo import collectives

RECIPES = (
  "jit",
  "jit, Auto mesh",
  "jit, axis_name",
  "shard_map, axis_name",
  "jit scan",
  "jit scan, Auto mesh",
  "jit scan, axis_name",
  "shard_map scan, axis_name",
)


def _window_bytes(lowered: dict[str, Any], k: int, in_graph: bool) -> int:
  """Bytes all collectives move in one window of ``k`` micro-batches."""
  total = 0
  for program, low in lowered.items():
    found = collectives(low.compile().as_text())
    once = sum(c.bytes for c in found if not (c.in_loop or c.in_branch))
    per_micro_batch = sum(c.bytes for c in found if c.in_loop)
    ending = sum(c.bytes for c in found if c.in_branch and not c.in_loop)
    if program == "scan":
      total += once + ending + k * per_micro_batch
    elif program == "accumulate":
      total += (k - 1) * once
    else:  # The update program: once a window, or every micro-step in-graph;
      # its branches run where a window ends.
      total += (k if in_graph else 1) * once + ending
  return total


def bench(
  recipe: str, k: int, width: int, depth: int, rows: int, rounds: Rounds, windows: int
) -> dict[str, Any]:
  # jax.make_mesh's default axes are Explicit (where plain jit reduces once
  # per window); before jax 0.7 they were Auto.
  kind = jax.sharding.AxisType.Auto if "Auto" in recipe else None
  mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,) if kind else None)
  model = mlp(width, depth, rows)
  params0, loss_fn = model["params"], model["loss_fn"]
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params0))
  scan = "scan" in recipe
  axis_name = "data" if "axis_name" in recipe else None
  opt = optax_accum.MultiSteps(optax.adamw(1e-4), k)
  step = optax_accum.make_train_step(
    loss_fn, opt, mode="scan" if scan else "stream", axis_name=axis_name
  )
  batch = model["batch"](k * rows if scan else rows)
  if scan:
    batch = optax_accum.split_micro_batches(batch, k)
  rows_spec = P(None, "data") if scan else P("data")
  in_graph = recipe.startswith("shard_map")
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  if in_graph:
    run = jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), rows_spec), out_specs=(P(), P(), P())
      ),
      donate_argnums=(0, 1),
    )
  else:
    run = step
  batch = jax.device_put(batch, NamedSharding(mesh, rows_spec))
  # The step's own layout (the step keeps a state's: opt.init's one sum would
  # reduce every micro-batch); in your shard_map, the one sum.
  state = opt.init(params) if in_graph else step.init(params)
  params, state, _ = run(params, state, batch)  # Compiles.
  if in_graph:  # The whole step traced inside the caller's shard_map.
    lowered = {"scan" if scan else "update": run.lower(params, state, batch)}
  elif scan:
    lowered = {"scan": step.lower(params, state, batch)}
  else:
    lowered = {
      name: step.lower(params, state, batch, program=name)
      for name in ("accumulate", "update")
    }
  reduced = _window_bytes(lowered, k, in_graph)

  carry = [params, state]
  calls = windows if scan else windows * k

  def loop() -> Any:
    params, state = carry
    for _ in range(calls):
      params, state, _ = run(params, state, batch)
    carry[:] = [params, state]
    return params

  rounds.add(recipe, loop, windows)
  return {"bytes_per_window": reduced, "params_bytes": param_bytes}


def markdown(rows: list[dict[str, Any]]) -> str:
  lines = [
    "| recipe | k | bytes reduced per window / params bytes | ms per window |",
    "|---|---|---|---|",
  ]
  for row in rows:
    ratio = row["bytes_per_window"] / row["params_bytes"]
    lines.append(f"| {row['recipe']} | {row['k']} | {ratio:.2f} | {row['ms']:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16])
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
  parser.add_argument("--windows", type=int, default=2, help="windows per round")
  parser.add_argument("--machine", default=None, help="results name (default: derived)")
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
  args = parser.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit("needs 8 devices: run it as its own process")
  machine = args.machine or f"{jax.devices()[0].platform}-{platform.machine()}"
  rows = []
  for k in args.ks:
    rounds = Rounds()
    found = {
      recipe: bench(recipe, k, args.width, args.depth, args.rows, rounds, args.windows)
      for recipe in RECIPES
    }
    rounds.run(args.repeats, warmup=1)
    for recipe, result in found.items():
      rows.append({"recipe": recipe, "k": k, **result, **rounds.stats(recipe)})
  rows.sort(key=lambda row: (RECIPES.index(row["recipe"]), row["k"]))
  table = markdown(rows)
  args.out.mkdir(parents=True, exist_ok=True)
  meta = {"devices": jax.device_count(), "jax": jax.__version__, **vars(args)}
  meta.update(machine=machine)
  del meta["out"]
  name = f"{machine}-data-parallel"
  (args.out / f"{name}.json").write_text(
    json.dumps({"meta": meta, "rows": rows}, indent=1)
  )
  (args.out / f"{name}.md").write_text(
    f"# {machine}, {jax.device_count()} simulated devices\n\n{table}"
  )
  print(table)
  return rows


if __name__ == "__main__":
  main()

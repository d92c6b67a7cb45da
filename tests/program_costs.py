"""XLA's cost and memory figures of the train step's programs on benchmark models.

``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m
tests.program_costs`` writes them to ``tests/data/program_costs.json`` (fully
optimised, as the test suite's 8 CPU devices: ``JAX_DISABLE_MOST_OPTIMIZATIONS=0``);
``tests/test_program_costs.py`` checks that no program does more work than the
recorded figures. Both are deterministic for one jax version, so a refactor
that adds a pass or a buffer to a program fails the test.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from benchmarks.accumulation import MODELS, many_leaves, mlp

RECORD = pathlib.Path(__file__).parent / "data" / "program_costs.json"
K = 4
#: (model, mode, axis_name) of every recorded configuration.
CONFIGS = (
  ("mlp-1024x8-b4", "stream", None),
  ("mlp-1024x8-b4", "scan", None),
  ("leaves-100x32-b4", "stream", None),
  ("leaves-100x32-b4", "scan", None),
  ("mlp-256x4-b8", "stream", "data"),
  ("mlp-256x4-b8", "scan", "data"),
)


#: Models of the recorded configurations beside the benchmark's: a data-parallel
#: MLP, and 100 small leaves (per-leaf work shows as well as at 400, in a
#: quarter of the compile time).
_OWN = {
  "mlp-256x4-b8": lambda: mlp(256, 4, 8),
  "leaves-100x32-b4": lambda: many_leaves(100, 32, 4),
}


def _model(name: str) -> dict[str, Any]:
  return _OWN[name]() if name in _OWN else MODELS[name]()


def figures(lowered: jax.stages.Lowered) -> dict[str, float]:
  compiled = lowered.compile()
  cost = compiled.cost_analysis()
  memory = compiled.memory_analysis()
  return {
    "flops": float(cost.get("flops", 0.0)),
    "bytes accessed": float(cost.get("bytes accessed", 0.0)),
    "temp bytes": float(memory.temp_size_in_bytes),
  }


def program_costs(model: str, mode: str, axis_name: str | None) -> dict[str, Any]:
  """The figures of each program of one configuration, by program name."""
  built = _model(model)
  params, batch = built["params"], built["batch"](built["rows"] * K)
  if mode == "scan":
    batch = optax_accum.split_micro_batches(batch, K)
  else:
    batch = jax.tree.map(lambda x: x[: built["rows"]], batch)
  if axis_name is not None:
    mesh = jax.make_mesh((8,), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    rows = P(None, axis_name) if mode == "scan" else P(axis_name)
    batch = jax.device_put(batch, NamedSharding(mesh, rows))
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  step = optax_accum.make_train_step(
    built["loss_fn"], opt, mode=mode, axis_name=axis_name
  )
  state = step.init(params)
  programs = ("accumulate", "update") if mode == "stream" else ("update",)
  return {
    name: figures(step.lower(params, state, batch, program=name)) for name in programs
  }


def key(model: str, mode: str, axis_name: str | None) -> str:
  return f"{model} {mode}" + (f" axis_name={axis_name}" if axis_name else "")


def main() -> None:
  record = {"jax": jax.__version__, "k": K, "programs": {}}
  for config in CONFIGS:
    record["programs"][key(*config)] = program_costs(*config)
    print(key(*config), record["programs"][key(*config)])
  RECORD.parent.mkdir(exist_ok=True)
  RECORD.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()

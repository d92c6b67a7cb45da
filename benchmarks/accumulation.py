"""Accumulation at the cost limit: optax_accum vs optax.MultiSteps, side by side.

Run from the repository root with ``python -m benchmarks.accumulation`` (or
``make bench``). For each model and ``k`` it times, in one process, on the same
model and data:

1. ``plain``: one micro-batch's gradient, AdamW and the params update;
2. ``limit``: one micro-batch's gradient plus one add into an accumulator,
   which is all a micro-step that does not end a window has to do;
3. ``optax``: ``optax.MultiSteps`` per micro-step (with and without donated
   buffers; the better one is kept);
4. ``stream``: ``optax_accum.make_train_step`` streaming, per micro-step, both
   on micro-steps that do not end a window and averaged over whole windows;
5. ``scan``: ``make_train_step(mode="scan")``, per window of ``k``;
6. ``whole``: the ``k`` micro-batches at once, one step.

Wall times are medians over repeated runs after warm-up (with min and max),
interleaved: each round runs every variant once, so machine noise hits all alike.
FLOPs and bytes come from XLA's ``cost_analysis()``, memory from
``memory_analysis()``; both are deterministic. Results go to
``benchmarks/results/<machine>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

RESULTS = pathlib.Path(__file__).parent / "results"


# --- models ---------------------------------------------------------------------


def mlp(width: int, depth: int, micro_batch: int) -> dict[str, Any]:
  """A tanh MLP regressor and one micro-batch of data for it."""
  keys = jax.random.split(jax.random.key(0), depth)
  params = {
    f"w{i}": jax.random.normal(key, (width, width)) / width**0.5
    for i, key in enumerate(keys)
  }

  def loss_fn(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    h = batch["x"]
    for i in range(depth):
      h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2), jnp.float32(batch["x"].shape[0])

  rng = np.random.default_rng(0)

  def batch(rows: int) -> dict[str, np.ndarray]:
    return {
      "x": rng.normal(size=(rows, width)).astype(np.float32),
      "y": rng.normal(size=(rows, width)).astype(np.float32),
    }

  return {"params": params, "loss_fn": loss_fn, "batch": batch, "rows": micro_batch}


MODELS = {
  # Tiny, for the smoke test.
  "mlp-64x2-b4": lambda: mlp(64, 2, 4),
  # Memory-bound: 8M params, 4 rows per micro-batch.
  "mlp-1024x8-b4": lambda: mlp(1024, 8, 4),
  # Compute-bound: 1M params, 512 rows per micro-batch.
  "mlp-512x4-b512": lambda: mlp(512, 4, 512),
}


# --- measurement ----------------------------------------------------------------


def _copy(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


class _Rounds:
  """Interleaved timing: every round runs every variant once, in turn.

  A disturbance of the machine (another process, a noisy neighbour) then
  lands on all variants alike instead of on one variant's whole block of
  repeats, so the ratios between them stay honest.
  """

  def __init__(self) -> None:
    self.times: dict[str, list[float]] = {}
    self.recording = False

  def timed(self, name: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn()`` (which must block) and records its wall time in ms."""
    start = time.perf_counter()
    out = fn()
    elapsed = (time.perf_counter() - start) * 1e3
    if self.recording:
      self.times.setdefault(name, []).append(elapsed)
    return out

  def run(self, variants: list[Callable[[], None]], repeats: int, warmup: int = 2):
    for round_ in range(warmup + repeats):
      self.recording = round_ >= warmup
      for variant in variants:
        variant()

  def stats(self, name: str, scale: float = 1.0) -> dict[str, float]:
    times = [t / scale for t in self.times[name]]
    return {"ms": statistics.median(times), "min": min(times), "max": max(times)}


def _analysis(jitted: Any, *args: Any) -> dict[str, float]:
  """Compile time, FLOPs, bytes accessed and memory of one compiled program."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # Older JAX returned one dict per device.
    cost = cost[0]
  memory = compiled.memory_analysis()
  return {
    "compile_s": seconds,
    "flops": float(cost.get("flops", float("nan"))),
    "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
    "argument_bytes": float(memory.argument_size_in_bytes),
    "output_bytes": float(memory.output_size_in_bytes),
    "temp_bytes": float(memory.temp_size_in_bytes),
  }


def bench_model(name: str, k: int, repeats: int) -> dict[str, Any]:
  model = MODELS[name]()
  loss_fn, params0, rows = model["loss_fn"], model["params"], model["rows"]
  micro = jax.device_put(model["batch"](rows))
  window = jax.device_put(model["batch"](rows * k))
  adamw = optax.adamw(1e-4)
  results: dict[str, Any] = {}
  rounds = _Rounds()
  variants = []

  def carried(name: str, jitted: Any, carry: list, *args: Any) -> Callable[[], None]:
    """A variant that calls ``jitted(*carry, *args)`` and carries its outputs."""

    def run() -> None:
      carry[:] = rounds.timed(
        name, lambda: jax.block_until_ready(jitted(*carry, *args))
      )

    return run

  # (1) plain step on one micro-batch.
  def plain(params, state, batch):
    grads, _ = jax.grad(loss_fn, has_aux=True)(params, batch)
    updates, state = adamw.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  plain_jit = jax.jit(plain, donate_argnums=(0, 1))
  carry = [_copy(params0), adamw.init(params0)]
  results["plain"] = _analysis(plain_jit, *carry, micro)
  variants.append(carried("plain", plain_jit, carry, micro))

  # One optimizer update and apply alone (for the scan target).
  def opt_only(params, state, grads):
    updates, state = adamw.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  opt_jit = jax.jit(opt_only, donate_argnums=(0, 1))
  grads0 = jax.tree.map(jnp.ones_like, params0)
  carry = [_copy(params0), adamw.init(params0)]
  variants.append(carried("optimizer_only", opt_jit, carry, grads0))

  # (2) the limit: gradient plus one add, accumulator donated.
  def limit(params, acc, batch):
    grads, _ = jax.grad(loss_fn, has_aux=True)(params, batch)
    return jax.tree.map(jnp.add, acc, grads)

  limit_jit = jax.jit(limit, donate_argnums=(1,))
  acc = [jax.tree.map(jnp.zeros_like, params0)]
  results["limit"] = _analysis(limit_jit, params0, acc[0], micro)

  def run_limit():
    acc[0] = rounds.timed(
      "limit", lambda: jax.block_until_ready(limit_jit(params0, acc[0], micro))
    )

  variants.append(run_limit)

  # (3) optax.MultiSteps, with and without donation, k calls a round.
  ms = optax.MultiSteps(adamw, k)

  def optax_step(params, state, batch):
    grads, _ = jax.grad(loss_fn, has_aux=True)(params, batch)
    updates, state = ms.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for donate in (True, False):
    label = f"optax_{'donated' if donate else 'plain'}"
    jitted = jax.jit(optax_step, donate_argnums=(0, 1) if donate else ())
    carry = [_copy(params0), ms.init(params0)]
    results[label] = _analysis(jitted, *carry, micro)
    one_call = carried(label, jitted, carry, micro)
    variants.append(lambda one_call=one_call: [one_call() for _ in range(k)])

  # (4) optax_accum streaming: one window a round, each call timed.
  accum = optax_accum.MultiSteps(adamw, k)
  step = optax_accum.make_train_step(loss_fn, accum)
  state = [_copy(params0), accum.init(params0)]
  results["stream_accumulate"] = _analysis(step.accumulate_program, *state, micro, None)
  results["stream_update"] = _analysis(step.update_program, *state, micro, None, False)

  def run_stream_window():
    start = time.perf_counter()
    for i in range(k):
      kind = "stream_end" if i == k - 1 else "stream_mid"
      state[:] = rounds.timed(kind, lambda: jax.block_until_ready(step(*state, micro)))[
        :2
      ]
      assert bool(state[1].updated) == (i == k - 1)  # Rounds stay window-aligned.
    if rounds.recording:
      rounds.times.setdefault("stream_window", []).append(
        (time.perf_counter() - start) * 1e3
      )

  variants.append(run_stream_window)

  # (5) scan mode, per window.
  scan = optax_accum.make_train_step(loss_fn, accum, mode="scan")
  stacked = optax_accum.split_micro_batches(window, k)
  carry = [_copy(params0), accum.init(params0)]
  results["scan"] = _analysis(scan.update_program, *carry, stacked, None)

  def run_scan(carry: list = carry) -> None:  # Bound now: `carry` is reused below.
    out = rounds.timed("scan", lambda: jax.block_until_ready(scan(*carry, stacked)))
    carry[:] = out[:2]

  variants.append(run_scan)

  # (6) the whole window's micro-batches at once.
  carry = [_copy(params0), adamw.init(params0)]
  results["whole"] = _analysis(plain_jit, *carry, window)
  variants.append(carried("whole", plain_jit, carry, window))

  rounds.run(variants, repeats)
  for label in ("plain", "limit", "optax_donated", "optax_plain", "scan", "whole"):
    results[label].update(rounds.stats(label))
  results["optimizer_only"] = rounds.stats("optimizer_only")
  results["optax"] = min(
    (results["optax_donated"], results["optax_plain"]), key=lambda r: r["ms"]
  )
  if k > 1:
    results["stream_mid"] = rounds.stats("stream_mid")
  results["stream_avg"] = rounds.stats("stream_window", scale=k)
  return results


def targets(
  name: str, k: int, r: dict[str, Any]
) -> dict[str, tuple[float, float, bool]]:
  """Each target: (measured ratio, bound, holds)."""
  out = {}
  if "stream_mid" in r:
    ratio = r["stream_mid"]["ms"] / r["limit"]["ms"]
    out["stream non-final / limit"] = (ratio, 1.10, ratio <= 1.10)
  if name == "mlp-1024x8-b4" and k == 16:
    ratio = r["stream_avg"]["ms"] / r["optax"]["ms"]
    out["stream avg / optax.MultiSteps"] = (ratio, 0.85, ratio <= 0.85)
  bound = k * r["limit"]["ms"] + r["optimizer_only"]["ms"]
  ratio = r["scan"]["ms"] / bound
  out["scan / (k*limit + optimizer)"] = (ratio, 1.05, ratio <= 1.05)
  # Memory: both streaming programs against optax.MultiSteps, all donated.
  temp = max(r["stream_accumulate"]["temp_bytes"], r["stream_update"]["temp_bytes"])
  ratio = temp / max(r["optax_donated"]["temp_bytes"], 1.0)
  out["stream temp bytes / optax"] = (ratio, 1.0, ratio <= 1.0)
  return out


# --- reporting ------------------------------------------------------------------


def markdown(runs: list[dict[str, Any]]) -> str:
  lines = [
    "| model | k | limit ms | stream non-final ms | stream avg ms | optax ms | "
    "scan ms/window | whole ms | non-final / limit | avg / optax |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for run in runs:
    r = run["results"]
    mid = r.get("stream_mid", {}).get("ms", float("nan"))
    lines.append(
      f"| {run['model']} | {run['k']} | {r['limit']['ms']:.2f} | {mid:.2f} | "
      f"{r['stream_avg']['ms']:.2f} | {r['optax']['ms']:.2f} | {r['scan']['ms']:.2f} | "
      f"{r['whole']['ms']:.2f} | {mid / r['limit']['ms']:.2f} | "
      f"{r['stream_avg']['ms'] / r['optax']['ms']:.2f} |"
    )
  lines += [
    "",
    "| model | k | target | measured | bound | holds |",
    "|---|---|---|---|---|---|",
  ]
  for run in runs:
    for target, (ratio, bound, holds) in run["targets"].items():
      lines.append(
        f"| {run['model']} | {run['k']} | {target} | {ratio:.3f} | {bound:.2f} | "
        f"{'yes' if holds else 'NO'} |"
      )
  return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = sorted({run["model"] for run in runs})
  fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.6))
  for ax, model in zip(np.atleast_1d(axes), models, strict=True):
    chosen = [run for run in runs if run["model"] == model]
    ks = [run["k"] for run in chosen]
    for key, label in [
      ("limit", "gradient + add (limit)"),
      ("stream_avg", "optax_accum stream (avg)"),
      ("optax", "optax.MultiSteps"),
    ]:
      ax.plot(
        ks, [run["results"][key]["ms"] for run in chosen], marker="o", label=label
      )
    scan = [run["results"]["scan"]["ms"] / run["k"] for run in chosen]
    ax.plot(ks, scan, marker="o", label="optax_accum scan (per micro-step)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per update (k)")
    ax.set_ylabel("ms per micro-step")
    ax.set_title(model)
    ax.set_ylim(bottom=0)
  np.atleast_1d(axes)[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--models",
    nargs="+",
    default=["mlp-1024x8-b4", "mlp-512x4-b512"],
    choices=list(MODELS),
  )
  parser.add_argument("--ks", nargs="+", type=int, default=[1, 4, 16])
  parser.add_argument("--repeats", type=int, default=10, help="timed runs per entry")
  parser.add_argument("--machine", default=None, help="results name (default: derived)")
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
  args = parser.parse_args(argv)
  from tqdm import tqdm

  device = jax.devices()[0]
  machine = (
    args.machine or f"{device.platform}-{platform.machine()}-{jax.device_count()}dev"
  )
  runs = []
  configs = [(m, k) for m in args.models for k in args.ks]
  for model, k in tqdm(configs, desc="benchmarks", unit="config"):
    results = bench_model(model, k, args.repeats)
    runs.append(
      {
        "model": model,
        "k": k,
        "results": results,
        "targets": targets(model, k, results),
      }
    )
  args.out.mkdir(parents=True, exist_ok=True)
  meta = {
    "machine": machine,
    "device": str(device.device_kind),
    "jax": jax.__version__,
    "optax": optax.__version__,
  }
  (args.out / f"{machine}.json").write_text(
    json.dumps({"meta": meta, "runs": runs}, indent=1)
  )
  table = markdown(runs)
  (args.out / f"{machine}.md").write_text(f"# {machine} ({meta['device']})\n\n{table}")
  plot(runs, args.out / f"{machine}.png")
  print(table)
  return runs


if __name__ == "__main__":
  main()

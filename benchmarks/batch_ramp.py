"""A window that follows the noise scale against fixed ones (issue 62).

The project's LM (``accumulation.causal_lm``, here 2 blocks of width 64) learns
the bytes of the text the package ships (``optax_accum/data/corpus.txt``):
micro-batches of 8 random windows of 32 bytes, padded to random lengths. Every
run consumes the same token budget, from the same micro-batches in the same
order for a seed, with the same optimizer (the recipe of
``docs/noise_scale.md``: ``progress_schedule(unit="weight")`` for a warmup-cosine
learning rate in tokens, ``adamw_in_items`` tuned at a reference window of
``--reference`` micro-batches), and differs only in where windows end:

- ``small``: a fixed window of ``--small`` micro-batches;
- ``large``: a fixed window of ``--large`` micro-batches;
- ``ramp``: a linear ramp from small to large over the first ``--ramp`` of the
  budget, fixed in advance (as MaxText's and OLMo-core's);
- ``controller``: ``WindowController`` between the small and large windows.

Per run: the final loss (token mean over a fixed set of 64 windows of the
text), the tokens it took to reach the large window's final loss (the same
seed's), optimizer updates and wall time (compiles excluded: one step serves
every run). Results go to ``benchmarks/results/<machine>-batch-ramp.{md,json,png}``
and the plot also to ``docs/images/batch_ramp.png``.

  python -m benchmarks.batch_ramp [--seeds 0 1 2] [--budget 240000] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import platform
import time
from typing import Any

import jax
import numpy as np
import optax

import optax_accum
from benchmarks import accumulation
from optax_accum import demo

LENGTH, ROWS, BLOCKS, WIDTH = 32, 8, 2, 64
RUNS = ("small", "large", "ramp", "controller")
DOCS_PLOT = pathlib.Path(__file__).parents[1] / "docs" / "images" / "batch_ramp.png"


def data(seed: int, count: int) -> list[dict[str, np.ndarray]]:
  """``count`` micro-batches of random windows of the text, as bytes."""
  ids = np.frombuffer(demo.corpus().encode(), np.uint8).astype(np.int32)
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    starts = rng.integers(0, len(ids) - LENGTH - 1, ROWS)
    text = np.stack([ids[s : s + LENGTH + 1] for s in starts])
    lengths = rng.integers(LENGTH // 4, LENGTH + 1, (ROWS, 1))
    mask = (np.arange(LENGTH) < lengths).astype(np.float32)
    out.append({"inputs": text[:, :-1], "targets": text[:, 1:], "mask": mask})
  return out


def model(seed: int) -> tuple[Any, Any]:
  """The LM's loss and params drawn for ``seed`` (each matrix at the scale of
  ``causal_lm``'s own draw; norms and biases as they are)."""
  lm = accumulation.causal_lm(BLOCKS, WIDTH, 4, LENGTH, ROWS)
  leaves, tree = jax.tree.flatten(lm["params"])
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  drawn = [
    jax.random.normal(k, x.shape) * x.std() if x.ndim == 2 else x
    for k, x in zip(keys, leaves, strict=True)
  ]
  return lm["loss_fn"], jax.tree.unflatten(tree, drawn)


def optimizer(budget: float, reference: float, peak: float) -> optax_accum.MultiSteps:
  """The recipe: learning rate in tokens, Adam in items, windows ended by the loop."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, peak, 0.05 * budget / reference, budget / reference, end_value=0.1 * peak
  )
  lr = optax_accum.progress_schedule(schedule, unit="weight", per_update=reference)
  inner = optax.inject_hyperparams(optax_accum.adamw_in_items)(
    learning_rate=lr, weight_decay=0.01, reference_weight=reference
  )
  return optax_accum.MultiSteps(inner, every_k_schedule="end_window", noise_scale=True)


class Ender:
  """Where a run's windows end: after ``k(tokens so far)`` micro-batches, or
  where the controller says."""

  def __init__(self, name: str, args: argparse.Namespace, per: float, budget: float):
    self.name, self.args, self.budget = name, args, budget
    self.ctl = optax_accum.WindowController(
      args.small * per, args.large * per, scale=args.scale
    )
    self.state = self.ctl.init()
    self.count = 0

  def k(self, seen: float) -> int:
    a = self.args
    if self.name == "small":
      return a.small
    if self.name == "large":
      return a.large
    share = min(seen / (a.ramp * self.budget), 1.0)
    return round(a.small + share * (a.large - a.small))

  def add(self, weight: float, seen: float) -> bool:
    self.count += 1
    if self.name == "controller":
      self.state, end = self.ctl.add(self.state, weight)
      return end
    return self.count >= self.k(seen)

  def end(self, metrics: dict[str, Any]) -> dict[str, Any]:
    self.count = 0
    if self.name != "controller":
      return {"learning_rate": metrics["learning_rate"]}
    self.state, record = self.ctl.end(self.state, metrics)
    return record


def run(
  name: str, seed: int, args: argparse.Namespace, step: Any, evaluate: Any
) -> dict[str, Any]:
  _, params = model(seed)
  batches = data(seed, args.budget // (ROWS * LENGTH // 4) + 1)
  held = jax.tree.map(lambda *x: np.concatenate(x), *data(1000, 64 // ROWS))
  per = float(np.mean([b["mask"].sum() for b in batches]))
  ender = Ender(name, args, per, args.budget)
  state, seen, window, windows, curve = step.init(params), 0.0, 0.0, [], []
  next_eval, updates = 0.0, 0
  jax.block_until_ready((params, state))
  start = time.perf_counter()
  for batch in batches:
    tokens = float(batch["mask"].sum())
    end = ender.add(tokens, seen) or seen + tokens >= args.budget
    params, state, metrics = step(params, state, batch, end_window=end)
    seen, window = seen + tokens, window + tokens
    if not end:
      continue
    record = ender.end(metrics)
    windows.append(record | {"tokens": seen, "window": window})
    updates, window = updates + 1, 0.0
    if seen >= next_eval or seen >= args.budget:
      curve.append((seen, evaluate(params, held)[0]))
      next_eval += args.budget / 40
    if seen >= args.budget:
      break
  jax.block_until_ready(params)
  wall = time.perf_counter() - start
  curve = [(t, float(loss)) for t, loss in curve]
  windows = jax.device_get(windows)
  return {"name": name, "seed": seed, "updates": updates, "wall_s": wall} | {
    "final_loss": curve[-1][1],
    "curve": curve,
    "windows": windows,
    "per": per,
  }


def warm(step: Any, evaluate: Any) -> None:
  """Compiles the step's programs and the evaluation before any run is timed."""
  _, params = model(0)
  state, held = step.init(params), data(0, 64 // ROWS)
  for end in (False, True):
    params, state, _ = step(params, state, held[0], end_window=end)
  held = jax.tree.map(lambda *x: np.concatenate(x), *held)
  jax.block_until_ready(evaluate(params, held))


def reached(curve: list[tuple[float, float]], target: float) -> float | None:
  """Tokens at which the loss first reaches ``target`` (linear between evals)."""
  for (t0, l0), (t1, l1) in itertools.pairwise(curve):
    if l1 <= target:
      share = 0.0 if l0 == l1 else min(max((l0 - target) / (l0 - l1), 0.0), 1.0)
      return t0 + share * (t1 - t0)
  return None


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  large = {r["seed"]: r["final_loss"] for r in runs if r["name"] == "large"}
  out = {}
  for name in RUNS:
    mine = [r for r in runs if r["name"] == name]
    hits = [reached(r["curve"], large[r["seed"]]) for r in mine]
    out[name] = {
      "final_loss": [r["final_loss"] for r in mine],
      "tokens_to_large": hits,
      "updates": [r["updates"] for r in mine],
      "wall_s": [r["wall_s"] for r in mine],
    }
  return out


def _kept(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """What the JSON keeps: every run's curve; the controller's windows."""
  return [
    r if r["name"] == "controller" else {k: v for k, v in r.items() if k != "windows"}
    for r in runs
  ]


def _spread(values: list[float], fmt: str) -> str:
  v = np.asarray(values, np.float64)
  return f"{v.mean():{fmt}} ± {v.std(ddof=1) if len(v) > 1 else 0.0:{fmt}}"


def markdown(table: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
  lines = [
    "| run | final loss | tokens to large's final loss | updates | wall s |",
    "|---|---|---|---|---|",
  ]
  for name, s in table.items():
    hits = [h for h in s["tokens_to_large"] if h is not None]
    reach = (
      f"{_spread(hits, ',.0f')} ({len(hits)}/{len(s['updates'])})" if hits else "-"
    )
    lines.append(
      f"| {name} | {_spread(s['final_loss'], '.4f')} | {reach} "
      f"| {_spread(s['updates'], '.0f')} | {_spread(s['wall_s'], '.1f')} |"
    )
  return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], paths: list[pathlib.Path]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
  for name in RUNS:
    curves = [np.asarray(r["curve"]) for r in runs if r["name"] == name]
    n = min(len(c) for c in curves)
    mean = np.mean([c[:n] for c in curves], axis=0)
    axes[0].plot(mean[:, 0] / 1e3, mean[:, 1], label=name)
  axes[0].set_xlabel("thousand tokens"), axes[0].set_ylabel("loss (mean of seeds)")
  axes[0].set_ylim(top=3.0), axes[0].legend(fontsize=8)
  ctl = next(r for r in runs if r["name"] == "controller")
  w = {key: np.asarray([x[key] for x in ctl["windows"]]) for key in ctl["windows"][0]}
  t = w["tokens"] / 1e3
  axes[1].plot(t, w["b_simple"], label="smoothed B_simple (read)")
  axes[1].plot(t, w["window"], label="window (tokens)")
  axes[1].plot(t, w["micro_batches"] * ctl["per"], ":", label="micro-batches x mean")
  for name in ("small", "large", "ramp"):
    other = next(r for r in runs if r["name"] == name and r["seed"] == ctl["seed"])
    o = {
      key: np.asarray([x[key] for x in other["windows"]])
      for key in ("tokens", "window")
    }
    axes[1].plot(o["tokens"] / 1e3, o["window"], lw=0.8, alpha=0.6, label=name)
  axes[1].set_yscale("log"), axes[1].set_xlabel("thousand tokens")
  axes[1].set_title("window size (seed 0)", fontsize=9), axes[1].legend(fontsize=7)
  axes[2].plot(t, w["learning_rate"], label="schedule (tokens)")
  applied = w["learning_rate"] * np.sqrt(w["window"] / ctl["reference"])
  axes[2].plot(t, applied, label="applied (sqrt rule)")
  axes[2].set_xlabel("thousand tokens"), axes[2].set_title("controller's learning rate")
  axes[2].legend(fontsize=8)
  fig.tight_layout()
  for path in paths:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--budget", type=int, default=240_000, help="tokens a run")
  parser.add_argument("--small", type=int, default=2, help="micro-batches")
  parser.add_argument("--large", type=int, default=16, help="micro-batches")
  parser.add_argument("--reference", type=int, default=4, help="micro-batches")
  parser.add_argument("--ramp", type=float, default=0.5, help="share of the budget")
  parser.add_argument("--peak", type=float, default=2e-3, help="learning rate")
  parser.add_argument("--scale", type=float, default=1.0, help="of B_simple")
  parser.add_argument("--out", default=accumulation.RESULTS)
  parser.add_argument("--docs-plot", default=str(DOCS_PLOT))
  args = parser.parse_args(argv)
  per = float(np.mean([b["mask"].sum() for b in data(0, 256)]))
  reference = args.reference * per
  loss_fn, _ = model(0)
  step = optax_accum.make_train_step(
    loss_fn, optimizer(args.budget, reference, args.peak)
  )
  evaluate = jax.jit(loss_fn)
  warm(step, evaluate)
  runs = []
  for seed in args.seeds:
    for name in RUNS:
      runs.append(run(name, seed, args, step, evaluate) | {"reference": reference})
      r = runs[-1]
      print(
        f"{name} seed {seed}: loss {r['final_loss']:.4f}, {r['updates']} updates, "
        f"{r['wall_s']:.1f} s",
        flush=True,
      )
  table = summary(runs)
  device = jax.devices()[0]
  machine = f"{device.platform}-{platform.machine()}"
  text = markdown(table, args)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python -m benchmarks.batch_ramp " + " ".join(argv or [])
  header = (
    f"# Batch-size ramp, {BLOCKS}-block LM on the shipped text, {machine}\n\n"
    f"{args.budget:,} tokens a run, seeds {args.seeds}, windows of {args.small} "
    f"(small) and {args.large} (large) micro-batches of {per:.0f} tokens on average; "
    f"mean ± std over seeds. `{command.strip()}`\n\n"
  )
  (out / f"{machine}-batch-ramp.md").write_text(header + text)
  meta = {
    "machine": machine,
    "jax": jax.__version__,
    "args": vars(args) | {"out": str(out)},
  }
  (out / f"{machine}-batch-ramp.json").write_text(
    json.dumps({"meta": meta, "summary": table, "runs": _kept(runs)}, default=float)
  )
  paths = [out / f"{machine}-batch-ramp.png"]
  plot(runs, paths + ([pathlib.Path(args.docs_plot)] if args.docs_plot else []))
  print(header + text)
  return table


if __name__ == "__main__":
  main()

"""Whole windows on a causal transformer LM: optax_accum against its floor.

Run with ``python -m benchmarks.lm`` (``make bench`` runs it). On
``accumulation.causal_lm`` (12 unscanned pre-LN blocks, 148 param leaves,
padded variable-length sequences, token-mean cross-entropy weighted by the
valid tokens, AdamW) and each ``k``, in one process, timed as loops run
(queued calls, one block per round, rounds interleaved in shuffled order,
medians with the spread over rounds), per window of ``k`` micro-batches:

- ``floor``: ``k`` bare accumulate calls (gradient and weighted add) and one
  AdamW call, the fastest by median of: the calls in one loop (per-leaf or
  contiguous accumulator), and the fastest accumulate call and the AdamW call
  each timed in a loop of its own;
- ``stream``: ``make_train_step`` streaming; ``in own jit``: the same step
  traced inside the caller's ``jit``; ``optax.MultiSteps``;
- ``scan``: ``make_train_step(mode="scan")``, against a hand-written window
  (``lax.scan`` summing weighted gradients and weights, divide, AdamW);
- ``whole``: the window's micro-batches in one gradient, where it fits.

Targets: stream <= 1.05 x floor and scan <= 1.03 x the hand-written window at
every ``k``; stream / optax.MultiSteps is reported. The script fails when a
variant beats its lower bound by more than noise (the bound is then wrong).
Results go to ``benchmarks/results/<machine>-lm.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
from statistics import median
from typing import Any

import jax
import optax

from benchmarks import accumulation

#: Variants timed per micro-step (a window is k of them) and per window.
PER_MICRO_STEP = ("limit", "stream", "stream_in_graph", "optax")
PER_WINDOW = ("optimizer", "scan", "scan_handwritten", "scan_limit", "whole")


def windows(r: dict[str, Any], k: int) -> dict[str, dict[str, float]]:
  """Each variant's window time (median, min, max in ms), and the floor's."""
  out = {}
  for label in PER_MICRO_STEP + PER_WINDOW:
    scale = k if label in PER_MICRO_STEP else 1
    out[label] = {stat: r[label][stat] * scale for stat in ("ms", "min", "max")}
  out["floor"] = {stat: r["floor"][stat] * k for stat in ("ms", "min", "max")}
  return out


def row(model: str, k: int, r: dict[str, Any]) -> dict[str, Any]:
  w, t = windows(r, k), accumulation.round_times(r, k)
  stream_items = k * r["items"]["micro_batch"]
  scan_items = r["items"]["window"]
  return {
    "model": model,
    "k": k,
    "windows_ms": w,
    # Medians of the rounds' ratios, as the targets.
    "stream / floor": median(t["stream"] / t["floor"]),
    "in own jit / floor": median(t["stream_in_graph"] / t["floor"]),
    "scan / hand-written": median(t["scan"] / t["scan_handwritten"]),
    "stream / optax.MultiSteps": median(t["stream"] / t["optax"]),
    "floor / optax.MultiSteps": median(t["floor"] / t["optax"]),
    "stream tokens/s": stream_items / w["stream"]["ms"] * 1e3,
    "scan tokens/s": scan_items / w["scan"]["ms"] * 1e3,
    "whole tokens/s": scan_items / w["whole"]["ms"] * 1e3,
    "targets": accumulation.targets(model, k, r),
    "bounds_violated": accumulation.bounds_violated(r),
  }


def markdown(rows: list[dict[str, Any]]) -> str:
  labels = [
    ("floor", "floor"),
    ("stream", "stream"),
    ("stream_in_graph", "in own jit"),
    ("optax", "optax.MultiSteps"),
    ("scan", "scan"),
    ("scan_handwritten", "hand-written scan"),
    ("whole", "whole batch"),
  ]
  head = " | ".join(f"{title} ms" for _, title in labels)
  lines = [f"| k | {head} |", "|---|" + "---|" * len(labels)]
  for r in rows:
    w = r["windows_ms"]
    cells = " | ".join(
      f"{w[label]['ms']:.1f} ({w[label]['min']:.1f}-{w[label]['max']:.1f})"
      for label, _ in labels
    )
    lines.append(f"| {r['k']} | {cells} |")
  ratios = [
    "stream / floor",
    "in own jit / floor",
    "scan / hand-written",
    "stream / optax.MultiSteps",
    "floor / optax.MultiSteps",
  ]
  speeds = ["stream tokens/s", "scan tokens/s", "whole tokens/s"]
  lines += ["", f"| k | {' | '.join(ratios + speeds)} |"]
  lines.append("|---|" + "---|" * (len(ratios) + len(speeds)))
  for r in rows:
    cells = [f"{r[name]:.3f}" for name in ratios] + [f"{r[s]:.0f}" for s in speeds]
    lines.append(f"| {r['k']} | {' | '.join(cells)} |")
  lines += ["", "| k | target | measured (middle half of rounds) | bound | holds |"]
  lines.append("|---|---|---|---|---|")
  for r in rows:
    for name in ("stream / floor", "scan / hand-written scan window"):
      cells = accumulation.target_cells(r["targets"][name])
      lines.append(f"| {r['k']} | {name} | {cells} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="lm-12x64-b8", choices=accumulation.MODELS)
  parser.add_argument("--ks", nargs="+", type=int, default=[4, 8, 16])
  parser.add_argument("--repeats", type=int, default=8, help="timed rounds")
  parser.add_argument("--windows", type=int, default=2, help="windows per round")
  parser.add_argument("--machine", default=None, help="results name (default: derived)")
  parser.add_argument("--out", default=accumulation.RESULTS)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  machine = args.machine or f"{device.platform}-{platform.machine()}"
  rows = []
  for k in args.ks:
    results = accumulation.bench_model(args.model, k, args.repeats, args.windows)
    rows.append(row(args.model, k, results))
  meta = {"machine": machine, "device": str(device.device_kind), "jax": jax.__version__}
  meta |= {"optax": optax.__version__, "model": args.model, "repeats": args.repeats}
  table = markdown(rows)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{machine}-lm.json").write_text(
    json.dumps({"meta": meta, "rows": rows}, indent=1)
  )
  (out / f"{machine}-lm.md").write_text(f"# {args.model} on {machine}\n\n{table}")
  print(table)
  violated = [f"k={r['k']}: {v}" for r in rows for v in r["bounds_violated"]]
  if violated:
    raise SystemExit(
      "A variant beat its lower bound, so the bound is wrong:\n" + "\n".join(violated)
    )
  return rows


if __name__ == "__main__":
  main()

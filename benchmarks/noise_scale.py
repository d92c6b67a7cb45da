"""What measuring the gradient noise scale costs (issue 51).

On the benchmark LM (``accumulation.causal_lm``: 12 unscanned blocks, 148
leaves, padded variable-length sequences, AdamW) the train step runs with
``MultiSteps(noise_scale=False)`` and ``True``, streaming and in scan mode,
timed as loops run (queued windows, one block per round, variants
interleaved in shuffled order; the median of the per-round ratios on / off).
Beside them, XLA's ``cost_analysis()`` of the program that runs most, off and
on: streaming, the accumulate program (a micro-step); in scan mode, the
window's.

Target: on / off <= 1.03 in time; off, the programs are those without the
feature (``tests/test_program_costs.py`` holds their figures).

  python -m benchmarks.noise_scale [--ks 8] [--rounds 8]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
from statistics import median
from typing import Any

import jax
import optax

import optax_accum
from benchmarks import accumulation

MODEL = "lm-12x64-b8"


class Loop:
  """A step run over queued windows, its params and state carried."""

  def __init__(self, step: Any, params: Any, batches: list[Any]):
    self.step, self.batches = step, batches
    self.params = accumulation.copy(params)
    self.state = step.init(self.params)

  def __call__(self) -> Any:
    for batch in self.batches:
      self.params, self.state, metrics = self.step(self.params, self.state, batch)
    return self.params, metrics


def _steps(model: dict[str, Any], k: int, noise: bool) -> dict[str, Any]:
  opt = optax_accum.MultiSteps(optax.adamw(1e-4), k, noise_scale=noise)
  loss_fn = model["loss_fn"]
  return {
    "stream": optax_accum.make_train_step(loss_fn, opt),
    "scan": optax_accum.make_train_step(loss_fn, opt, mode="scan"),
  }


def bench(
  k: int, rounds_: int, windows: int, name: str = MODEL
) -> list[dict[str, Any]]:
  model = accumulation.MODELS[name]()
  params, rows = model["params"], model["rows"]
  micro = [jax.device_put(model["batch"](rows)) for _ in range(k)]
  stacked = optax_accum.split_micro_batches(jax.device_put(model["batch"](rows * k)), k)
  rounds = accumulation.Rounds()
  analysis: dict[str, dict[str, float]] = {}
  for noise in (False, True):
    for mode, step in _steps(model, k, noise).items():
      name = f"{mode}_{'on' if noise else 'off'}"
      batches = micro * windows if mode == "stream" else [stacked] * windows
      loop = Loop(step, params, batches)
      program = "accumulate" if mode == "stream" else "update"  # A micro-step's.
      lowered = step.lower(loop.params, loop.state, batches[0], program=program)
      analysis[name] = accumulation._analysis(lowered)
      rounds.add(name, loop, windows)
  rounds.run(rounds_)
  rows = []
  for mode in ("stream", "scan"):
    off, on = rounds.stats(f"{mode}_off"), rounds.stats(f"{mode}_on")
    ratios = [b / a for a, b in zip(off["rounds"], on["rounds"], strict=True)]
    a_off, a_on = analysis[f"{mode}_off"], analysis[f"{mode}_on"]
    rows.append(
      {
        "mode": mode,
        "k": k,
        "off_ms": off["ms"],
        "on_ms": on["ms"],
        "ratio": median(ratios),
        "ratio_spread": (min(ratios), max(ratios)),
        "flops": (a_off["flops"], a_on["flops"]),
        "bytes": (a_off["bytes_accessed"], a_on["bytes_accessed"]),
      }
    )
  return rows


def markdown(rows: list[dict[str, Any]]) -> str:
  lines = [
    "| mode | k | off (ms a window) | on | on / off (median of rounds) "
    "| FLOPs off -> on | bytes off -> on |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lo, hi = r["ratio_spread"]
    flops = f"{r['flops'][0]:.4g} -> {r['flops'][1]:.4g} (+{_change(r['flops']):.3%})"
    moved = f"{r['bytes'][0]:.4g} -> {r['bytes'][1]:.4g} (+{_change(r['bytes']):.3%})"
    lines.append(
      f"| {r['mode']} | {r['k']} | {r['off_ms']:.1f} | {r['on_ms']:.1f} "
      f"| **{r['ratio']:.3f}** ({lo:.3f}-{hi:.3f}) | {flops} | {moved} |"
    )
  return "\n".join(lines) + "\n"


def _change(pair: tuple[float, float]) -> float:
  return pair[1] / pair[0] - 1


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ks", nargs="+", type=int, default=[8])
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--windows", type=int, default=2)
  parser.add_argument("--model", default=MODEL, choices=accumulation.MODELS)
  parser.add_argument("--out", default=accumulation.RESULTS)
  args = parser.parse_args(argv)
  rows = [r for k in args.ks for r in bench(k, args.rounds, args.windows, args.model)]
  device = jax.devices()[0]
  machine = f"{device.platform}-{platform.machine()}"
  table = markdown(rows)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  header = (
    f"# Noise scale on / off, {args.model} on {machine} ({device.device_kind})\n\n"
  )
  (out / f"{machine}-noise-scale.md").write_text(header + table)
  print(table)
  return rows


if __name__ == "__main__":
  main()

"""The train step against hand-written code on an accelerator, per window.

Run with ``python -m benchmarks.accelerator`` on the machine to measure
(``make bench`` runs it). For each model and ``k``, in one process, timed as
loops run (queued calls, one block per round, rounds interleaved in shuffled
order; ``benchmarks.accumulation``'s harness):

- ``stream``: ``make_train_step`` streaming, against ``stream_handwritten``
  (``k`` jitted gradient-and-add calls, then one call that divides, runs
  AdamW and empties the sum);
- ``scan``: ``make_train_step(mode="scan")``, against ``scan_handwritten``
  (a ``lax.scan`` window as MaxText writes one);
- ``in_jit``: the streaming step traced inside the caller's own ``jit``, one
  call per micro-step, and ``update_in_jit``: ``MultiSteps.update`` in the
  caller's ``jit``; against the better of two hand-written in-``jit`` steps,
  ``cond_handwritten`` (``lax.cond`` around AdamW) and ``select_handwritten``
  (AdamW on every micro-step, a select keeping the old values);
- ``optax``: ``optax.MultiSteps`` in the caller's ``jit``.

Targets: stream and scan <= 1.03 x their hand-written window, the steps in
the caller's ``jit`` <= 1.05 x the better hand-written in-``jit`` step.
Reported with tokens/s and model TFLOP/s (``flops_per_token`` of the model:
6 per param plus attention's). Results go to
``benchmarks/results/<platform>-<device>-accelerator.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections.abc import Callable
from statistics import median
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from benchmarks import accumulation
from benchmarks.accumulation import Carry, HandStream, Rounds, copy

#: Ratio targets: (variant, its reference, at most).
TARGETS = (
  ("stream", "stream_handwritten", 1.03),
  ("scan", "scan_handwritten", 1.03),
  ("in_jit", "best_handwritten_in_jit", 1.05),
  ("update_in_jit", "best_handwritten_in_jit", 1.05),
)
#: By whether the machine is a CPU: the GPT-2-sized LM only on an accelerator.
DEFAULT_MODELS = {False: ("lm-12x64-b8", "gpt2-small-b8"), True: ("lm-12x64-b8",)}
PER_MICRO_STEP = (
  "stream",
  "stream_handwritten",
  "in_jit",
  "update_in_jit",
  "cond_handwritten",
  "select_handwritten",
  "optax",
)


def hand_in_jit(
  loss_fn: Callable[..., Any], tx: Any, k: int, select: bool
) -> Callable[..., Any]:
  """A hand-written accumulating step for the caller's ``jit``: the gradient,
  a weighted add, and at the window's end AdamW on the mean, in a
  ``lax.cond`` or (``select``) always run and selected."""

  def step(params: Any, carry: Any, batch: Any) -> tuple[Any, Any]:
    state, acc, total, count = carry
    (_, w), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    acc = jax.tree.map(lambda a, b: a + w * b, acc, g)
    total, count = total + w, count + 1

    def apply() -> tuple[Any, Any, Any]:
      grads = jax.tree.map(lambda a: a / total, acc)
      updates, new = tx.update(grads, state, params)
      return (
        optax.apply_updates(params, updates),
        new,
        jax.tree.map(jnp.zeros_like, acc),
      )

    def hold() -> tuple[Any, Any, Any]:
      return params, state, acc

    ends = count == k
    if select:
      out = jax.tree.map(lambda a, h: jnp.where(ends, a, h), apply(), hold())
    else:
      out = jax.lax.cond(ends, apply, hold)
    params, state, acc = out
    total, count = jnp.where(ends, 0.0, total), jnp.where(ends, 0, count)
    return params, (state, acc, total, count)

  return step


def _multi_steps_in_jit(loss_fn: Callable[..., Any], opt: Any) -> Callable[..., Any]:
  def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
    (_, w), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, state = opt.update(g, state, params, weight=w)
    return optax.apply_updates(params, updates), state

  return step


def bench(name: str, k: int, repeats: int, windows: int) -> dict[str, Any]:
  """Each variant's median time per window (ms) and its rounds."""
  model = accumulation.MODELS[name]()
  loss_fn, params0, rows = model["loss_fn"], model["params"], model["rows"]
  micro = jax.device_put(model["batch"](rows))
  stacked = jax.device_put(optax_accum.split_micro_batches(model["batch"](rows * k), k))
  adamw = optax.adamw(1e-4)
  accum = optax_accum.MultiSteps(adamw, k)
  steps = windows * k
  rounds = Rounds()
  donated = {"donate_argnums": (0, 1)}

  stream = optax_accum.make_train_step(loss_fn, accum)
  rounds.add(
    "stream",
    Carry(stream, [copy(params0), accum.init(params0)], micro).loop(steps),
    steps,
  )
  hand = HandStream(loss_fn, adamw, k, params0)
  rounds.add("stream_handwritten", hand.loop(windows, micro), steps)

  scan = optax_accum.make_train_step(loss_fn, accum, mode="scan")
  scan_run = Carry(scan, [copy(params0), accum.init(params0)], stacked)
  rounds.add("scan", scan_run.loop(windows), windows)
  window = jax.jit(accumulation.hand_scan_window(loss_fn, adamw), **donated)
  window_run = Carry(window, [copy(params0), adamw.init(params0)], stacked)
  rounds.add("scan_handwritten", window_run.loop(windows), windows)

  in_jit = jax.jit(lambda p, s, b: stream(p, s, b)[:2], **donated)
  in_jit_run = Carry(in_jit, [copy(params0), accum.init(params0)], micro)
  rounds.add("in_jit", in_jit_run.loop(steps), steps)
  update = jax.jit(_multi_steps_in_jit(loss_fn, accum), **donated)
  update_run = Carry(update, [copy(params0), accum.init(params0)], micro)
  rounds.add("update_in_jit", update_run.loop(steps), steps)
  for label, select in (("cond_handwritten", False), ("select_handwritten", True)):
    fn = jax.jit(hand_in_jit(loss_fn, adamw, k, select), **donated)
    zeros = jax.tree.map(jnp.zeros_like, params0)
    carry = (adamw.init(params0), zeros, jnp.zeros([]), jnp.zeros([], jnp.int32))
    rounds.add(label, Carry(fn, [copy(params0), carry], micro).loop(steps), steps)
  ms = optax.MultiSteps(adamw, k)
  optax_run = Carry(
    jax.jit(accumulation.optax_in_jit(loss_fn, ms), **donated),
    [copy(params0), ms.init(params0)],
    micro,
  )
  rounds.add("optax", optax_run.loop(steps), steps)

  rounds.run(repeats)
  tokens = micro["inputs"].size
  return {
    "times": {
      label: [t * (k if label in PER_MICRO_STEP else 1) for t in rounds.times[label]]
      for label in rounds.variants
    },
    "tokens_per_window": tokens * k,
    "flops_per_token": model["flops_per_token"],
  }


def row(name: str, k: int, r: dict[str, Any]) -> dict[str, Any]:
  """Medians per window and the targets' ratios (medians of round ratios)."""
  t = {label: np.asarray(v) for label, v in r["times"].items()}
  t["best_handwritten_in_jit"] = np.minimum(
    t["cond_handwritten"], t["select_handwritten"]
  )
  ms = {label: float(median(v)) for label, v in t.items()}
  ratios = {
    f"{a} / {b}": (float(median(t[a] / t[b])), limit) for a, b, limit in TARGETS
  }
  ratios["stream / optax"] = (float(median(t["stream"] / t["optax"])), None)
  tokens, flops = r["tokens_per_window"], r["flops_per_token"]
  rate = {
    label: {
      "tokens/s": tokens / ms[label] * 1e3,
      "TFLOP/s": tokens * flops / ms[label] * 1e-9,
    }
    for label in ("stream", "scan", "stream_handwritten", "scan_handwritten")
  }
  rounds = {label: list(map(float, v)) for label, v in r["times"].items()}
  return {
    "model": name,
    "k": k,
    "window_ms": ms,
    "ratios": ratios,
    "rates": rate,
    "rounds_ms": rounds,
  }


def markdown(rows: list[dict[str, Any]], device: str) -> str:
  ratio_names = list(rows[0]["ratios"])
  head = ["model", "k", *ratio_names, "stream tokens/s", "stream TFLOP/s"]
  lines = [f"Device: {device}", "", "| " + " | ".join(head) + " |"]
  lines.append("|" + "---|" * len(head))
  for r in rows:
    cells = [r["model"], str(r["k"])]
    for name in ratio_names:
      value, limit = r["ratios"][name]
      mark = "" if limit is None else (" ok" if value <= limit else f" (> {limit})")
      cells.append(f"{value:.3f}{mark}")
    rate = r["rates"]["stream"]
    cells += [f"{rate['tokens/s']:.0f}", f"{rate['TFLOP/s']:.1f}"]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Per window, ms (median):", ""]
  labels = list(rows[0]["window_ms"])
  lines.append("| model | k | " + " | ".join(labels) + " |")
  lines.append("|" + "---|" * (len(labels) + 2))
  for r in rows:
    cells = [f"{r['window_ms'][label]:.2f}" for label in labels]
    lines.append(f"| {r['model']} | {r['k']} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--models", nargs="+", default=None, help="default: the LMs this machine fits"
  )
  parser.add_argument("--ks", nargs="+", type=int, default=[4, 8])
  parser.add_argument("--repeats", type=int, default=10, help="timed rounds")
  parser.add_argument("--windows", type=int, default=2, help="windows per round")
  parser.add_argument("--out", default=accumulation.RESULTS)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  models = args.models or list(DEFAULT_MODELS[device.platform == "cpu"])
  kind = re.sub(r"[^a-z0-9]+", "-", device.device_kind.lower()).strip("-")
  machine = "gpu" if device.platform in ("cuda", "rocm") else device.platform
  name = f"{machine}-{kind}-accelerator"
  meta = {"device": device.device_kind, "platform": device.platform}
  meta |= {"jax": jax.__version__, "optax": optax.__version__, "repeats": args.repeats}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  rows = []
  for model in models:
    for k in args.ks:
      rows.append(row(model, k, bench(model, k, args.repeats, args.windows)))
      # Written after every row: a run stopped early keeps what it measured.
      data = {"meta": meta, "rows": rows}
      (out / f"{name}.json").write_text(json.dumps(data, indent=1))
      table = markdown(rows, device.device_kind)
      (out / f"{name}.md").write_text(f"# The step on {machine}: {kind}\n\n{table}")
      print(markdown(rows[-1:], device.device_kind), flush=True)
  return rows


if __name__ == "__main__":
  main()

"""A window that follows the noise scale, against fixed windows and schedules
that can tell them apart (issue 71).

The data: the Python standard library's own source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, ``site-packages`` left out), as bytes
(vocabulary 256). Files go to train or eval by a hash of their relative path
(``--eval-share``, 10%), so no eval text is ever trained on. Train text is cut
into sequences of ``length + 1`` bytes that do not overlap; each seed draws
its run's sequences without replacement, so a run never sees a byte twice, and
every run of a seed sees the same micro-batches in the same order. The eval
set is a fixed draw from the eval files (the same for every run). Paths are
sorted, so the data depend on the seed and the Python version only (the
output records both and the byte counts).

The model: ``accumulation.causal_lm`` (2 blocks of width 64, 64-byte
contexts, micro-batches of 8 sequences, 512 tokens), its matrices drawn per
seed. The optimizer, the same for every run: ``adamw_in_items`` (Adam's decays
per token, the square-root rule for the learning rate against the reference
window of ``--reference`` micro-batches) under a warmup-cosine schedule in
tokens (``progress_schedule(unit="weight")``), inside
``MultiSteps(noise_scale=True)``, run by ``make_train_step(mode="scan")``: one
compiled program per window size, shared by every seed and learning rate
(the peak is a multiplier held in the optimizer state, ``inject_hyperparams``).

What runs:

1. **The learning rate**, tuned at the reference window on seeds of its own
   (``--tune-seeds``): multipliers ``--lr-sweep`` of ``--peak``; the best by
   held-out loss serves every other run (scaled by the square-root rule).
2. **Per seed** (``--seeds``), one token budget (``--budget``; the small
   window makes ``budget / 512`` updates): a fixed window of each of
   ``--windows`` micro-batches (``small`` the first, ``large`` the last), a
   fixed doubling schedule (``--doublings``: the window doubles from the small
   one at those shares of the budget, as the batch-size warmup of Merrill et
   al. 2025), ``switch`` (``--switch A B`` at half the budget) and
   ``controller`` (``WindowController`` with its defaults, from
   ``--controller-min`` micro-batches, the reference window unless given, to
   the large window; scan mode's ``choose_k``). ``--nu-per-item 0`` runs
   ``adamw_in_items`` with its second moment per update (before issue 71);
   ``--runs`` and ``--reuse`` train some runs again beside an earlier run's
   others; ``--replot`` draws a results JSON's plot again.
3. **Branches** (Merrill et al. 2025, arXiv 2505.23971): from seed
   ``--seeds[0]``'s small run at each share ``--branch-at`` of the budget,
   ``--branch-share`` of the budget more at each window and each learning-rate
   multiplier ``--branch-lrs``; the critical batch size there is the largest
   window whose best loss is within ``--tolerance`` nats of the small window's
   best.

Reported: final held-out loss per run, paired per-seed differences against
the best fixed window and against the small window with 95% intervals
(t-distribution), updates, wall time (compiles excluded); the switch against
both of its fixed windows; the branches' critical batch sizes beside the
smoothed ``B_simple``. Results go to ``benchmarks/results/<machine>-batch-ramp
.{md,json,png}``, the plot also to ``docs/images/batch_ramp.png``.

  python -m benchmarks.batch_ramp          # the full run (34 min on 2 shared cores)
  python -m benchmarks.batch_ramp --smoke  # a tiny model (the tests)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import pathlib
import platform
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from benchmarks import accumulation

#: blocks, width, heads, length (bytes of context), rows (a micro-batch's sequences).
FULL = {"blocks": 2, "width": 64, "heads": 4, "length": 64, "rows": 8}
SMOKE = {"blocks": 1, "width": 16, "heads": 2, "length": 16, "rows": 4}
DOCS_PLOT = pathlib.Path(__file__).parents[1] / "docs" / "images" / "batch_ramp.png"


def run_names(windows: Sequence[int]) -> tuple[str, ...]:
  """The runs of a seed: the fixed windows (``small`` the first, ``large`` the
  last), the doubling schedule, the switch and the controller."""
  fixed = ["small", *(f"fixed-{k}" for k in windows[1:-1]), "large"]
  return (*fixed, "doubling", "switch", "controller")


RUNS = run_names((1, 2, 4, 8, 16))


# The data.


@functools.cache
def stdlib_text(eval_share: float = 0.1) -> dict[str, Any]:
  """The standard library's ``*.py`` files as bytes, split into train and
  eval by a hash of each file's path relative to the library (sorted, so
  independent of the file system's order)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  paths = sorted(
    p.relative_to(root).as_posix()
    for p in root.rglob("*.py")
    if "site-packages" not in p.relative_to(root).parts
  )
  parts: dict[str, list[bytes]] = {"train": [], "eval": []}
  for rel in paths:
    digest = hashlib.sha256(rel.encode()).digest()
    side = "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_share else "train"
    parts[side].append((root / rel).read_bytes())
  text = {k: np.frombuffer(b"".join(v), np.uint8) for k, v in parts.items()}
  info = {
    "python": sys.version.split()[0],
    "stdlib": str(root),
    "files": {k: len(v) for k, v in parts.items()},
    "bytes": {k: int(v.size) for k, v in text.items()},
  }
  return text | {"info": info}


def sequences(text: np.ndarray, length: int) -> np.ndarray:
  """``text`` cut into sequences of ``length + 1`` bytes that do not overlap."""
  n = text.size // (length + 1)
  return text[: n * (length + 1)].reshape(n, length + 1)


def window_batch(x: np.ndarray) -> dict[str, np.ndarray]:
  """Sequences ``[..., length + 1]`` as the LM's batch: inputs, next bytes, mask."""
  x = x.astype(np.int32)
  mask = np.ones(x[..., 1:].shape, np.float32)
  return {"inputs": x[..., :-1], "targets": x[..., 1:], "mask": mask}


# The model and the optimizer.


def model(seed: int, size: dict[str, int]) -> tuple[Any, Any]:
  """The LM's loss and params drawn for ``seed`` (each matrix at the scale of
  ``causal_lm``'s own draw; norms and biases as they are)."""
  lm = accumulation.causal_lm(
    size["blocks"], size["width"], size["heads"], size["length"], size["rows"]
  )
  leaves, tree = jax.tree.flatten(lm["params"])
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  drawn = [
    jax.random.normal(k, x.shape) * x.std() if x.ndim == 2 else x
    for k, x in zip(keys, leaves, strict=True)
  ]
  return lm["loss_fn"], jax.tree.unflatten(tree, drawn)


def optimizer(
  budget: float, reference: float, nu_per_item: bool = True
) -> optax_accum.MultiSteps:
  """Warmup-cosine in tokens (peak 1), AdamW in items (square-root rule
  against ``reference`` tokens), then the peak: a multiplier held in the
  state (:func:`with_peak`), so one compiled program serves every peak."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, 1.0, 0.05 * budget / reference, budget / reference, end_value=0.1
  )
  lr = optax_accum.progress_schedule(schedule, unit="weight", per_update=reference)
  inner = optax.chain(
    optax.inject_hyperparams(optax_accum.adamw_in_items)(
      learning_rate=lr,
      weight_decay=0.01,
      reference_weight=reference,
      nu_per_item=nu_per_item,
    ),
    optax.inject_hyperparams(optax.scale)(step_size=1.0),
  )
  return optax_accum.MultiSteps(inner, every_k_schedule="end_window", noise_scale=True)


def with_peak(state: Any, peak: float) -> Any:
  """The optimizer state with the peak learning rate ``peak``."""
  adam, scale = state.inner_opt_state
  old = scale.hyperparams["step_size"]
  scale = scale._replace(hyperparams={"step_size": jnp.asarray(peak, old.dtype)})
  return state._replace(inner_opt_state=(adam, scale))


# Where windows end.


class Plan:
  """A run's windows: ``k(i)`` micro-batches from micro-batch ``i``, from
  ``(start, k)`` steps (a fixed window is one step); ``done`` sees each
  window's metrics. ``measure`` keeps the smoothed ``B_simple`` a controller
  would read (for the plot), without deciding anything."""

  def __init__(self, steps: Sequence[tuple[int, int]], measure: Any = None):
    self.steps, self.ctl = list(steps), measure
    self.state = measure.init() if measure is not None else None
    self.records: list[dict[str, Any]] = []

  def k(self, i: int) -> int:
    return [k for start, k in self.steps if start <= i][-1]

  def done(self, k: int, items: float, tokens: float, metrics: Any) -> None:
    if self.ctl is None:
      return
    self.state, _ = self.ctl.add(self.state, items, micro_batches=k)
    self.state, record = self.ctl.end(self.state, metrics)
    self.records.append(
      {key: record[key] for key in ("b_simple", "b_low", "b_high", "target")}
      | {"tokens": tokens}
    )


class Controlled(Plan):
  """``WindowController`` decides: scan mode's ``choose_k``."""

  def __init__(self, ctl: optax_accum.WindowController, per: float):
    super().__init__([], ctl)
    self.per = per

  def k(self, i: int) -> int:
    return self.ctl.choose_k(self.state, per_micro_batch=self.per)


def _fit(k: int, sizes: Sequence[int], left: int) -> int:
  """``k``, or the largest compiled size that fits in the micro-batches left."""
  return k if k <= left else max(s for s in sizes if s <= left)


# A run.


class Bench:
  """Everything runs share: data, the compiled step, the evaluation."""

  def __init__(self, args: argparse.Namespace):
    self.args, size = args, args.size
    self.per = float(size["rows"] * size["length"])
    self.total = args.budget_mb  # micro-batches a run
    text = stdlib_text(args.eval_share)
    self.info = text["info"]
    self.train_seqs = sequences(text["train"], size["length"])
    held = sequences(text["eval"], size["length"])
    pick = np.random.default_rng(12345).choice(len(held), args.eval_rows, replace=False)
    self.final_set = window_batch(held[np.sort(pick)])
    self.curve_set = jax.tree.map(lambda x: x[: args.curve_rows], self.final_set)
    self.loss_fn, _ = model(0, size)
    reference = args.reference * self.per
    self.step = optax_accum.make_train_step(
      self.loss_fn,
      optimizer(self.total * self.per, reference, bool(args.nu_per_item)),
      mode="scan",
    )
    self.evaluate = jax.jit(self.loss_fn)
    self.sizes = sorted(set(args.windows) | {args.reference, *args.switch})
    self._batches: dict[int, np.ndarray] = {}
    start = time.perf_counter()
    self._warm()
    self.compile_s = time.perf_counter() - start

  def batches(self, seed: int) -> np.ndarray:
    """Seed ``seed``'s micro-batches ``[total, rows, length + 1]``: sequences
    drawn without replacement."""
    if seed not in self._batches:
      rows = self.args.size["rows"]
      rng = np.random.default_rng([seed, 71])
      pick = rng.choice(len(self.train_seqs), self.total * rows, replace=False)
      self._batches[seed] = self.train_seqs[pick].reshape(self.total, rows, -1)
    return self._batches[seed]

  def _warm(self) -> None:
    """Compiles every window size's program and the evaluations, once."""
    _, params = model(0, self.args.size)
    state = self.step.init(params)
    x = sequences(stdlib_text(self.args.eval_share)["train"], self.args.size["length"])
    rows = self.args.size["rows"]
    for k in self.sizes:
      batch = window_batch(x[: k * rows].reshape(k, rows, -1))
      params, state, _ = self.step(params, state, batch)
    jax.block_until_ready(self.evaluate(params, self.curve_set))
    jax.block_until_ready(self.evaluate(params, self.final_set))

  def start(self, seed: int, peak: float) -> tuple[Any, Any]:
    _, params = model(seed, self.args.size)
    return params, with_peak(self.step.init(params), peak)

  def train(
    self,
    seed: int,
    plan: Plan,
    params: Any,
    state: Any,
    *,
    first: int = 0,
    stop: int | None = None,
    keep: Sequence[int] = (),
  ) -> dict[str, Any]:
    """Trains micro-batches ``first`` to ``stop`` of the seed's stream in the
    plan's windows; the held-out loss at every ``budget / curve_points`` and at
    the end; copies of ``(params, state)`` at the micro-batches ``keep``."""
    stop = self.total if stop is None else stop
    data, every = self.batches(seed), self.total / self.args.curve_points
    i, updates, curve, kept, windows = first, 0, [], {}, []
    next_eval = (math.floor(first / every) + 1) * every
    jax.block_until_ready((params, state))
    clock = time.perf_counter()
    while i < stop:
      k = _fit(plan.k(i), self.sizes, stop - i)
      params, state, metrics = self.step(params, state, window_batch(data[i : i + k]))
      i, updates = i + k, updates + 1
      if not windows or windows[-1][1] != k:
        windows.append([(i - k) * self.per, k, 0])
      windows[-1][2] += 1
      plan.done(k, k * self.per, i * self.per, metrics)
      if i >= next_eval and i < stop:
        curve.append((i * self.per, self.evaluate(params, self.curve_set)[0]))
        next_eval += every
      if i in keep:
        kept[i] = jax.device_get((params, state))
    final = float(self.evaluate(params, self.final_set)[0])
    wall = time.perf_counter() - clock
    curve = [(t, float(loss)) for t, loss in curve] + [(i * self.per, final)]
    return {
      "seed": seed,
      "final_loss": final,
      "updates": updates,
      "wall_s": wall,
      "curve": curve,
      "windows": windows,
      "records": jax.device_get(plan.records),
      "kept": kept,
    }

  # The plans.

  def plan(self, name: str) -> Plan:
    a, total = self.args, self.total
    fixed = dict(zip(run_names(a.windows), a.windows, strict=False))
    if name in fixed:
      measure = None
      if fixed[name] == a.reference:  # The plot's B_simple at a fixed window.
        measure = optax_accum.WindowController(self.per, a.windows[-1] * self.per)
      return Plan([(0, fixed[name])], measure)
    if name == "doubling":
      starts = [round(s * total) for s in a.doublings]
      ks = [a.windows[0] * 2**j for j in range(len(starts) + 1)]
      return Plan(list(zip([0, *starts], ks, strict=True)))
    if name == "switch":
      return Plan([(0, a.switch[0]), (total // 2, a.switch[1])])
    if name == "controller":
      scale = {} if a.scale is None else {"scale": a.scale}
      ctl = optax_accum.WindowController(
        a.controller_min * self.per, a.windows[-1] * self.per, **scale
      )
      return Controlled(ctl, self.per)
    raise ValueError(f"unknown run {name!r}")


# Statistics.


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
  """Mean of the per-seed differences ``a - b`` and its 95% interval (t)."""
  from scipy import stats

  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  n = d.size
  half = (
    float(stats.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n))
    if n > 1
    else math.inf
  )
  return {
    "mean": float(d.mean()),
    "low": float(d.mean() - half),
    "high": float(d.mean() + half),
  }


def _interval(p: dict[str, float]) -> str:
  return f"{p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]"


# The parts of the benchmark.


def tune(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
  """The peak learning rate at the reference window: the multiplier of
  ``--peak`` with the least held-out loss, mean over the tuning seeds."""
  a = bench.args
  losses: dict[float, list[float]] = {}
  for mult in a.lr_sweep:
    for seed in a.tune_seeds:
      params, state = bench.start(seed, a.peak * mult)
      r = bench.train(seed, Plan([(0, a.reference)]), params, state)
      losses.setdefault(mult, []).append(r["final_loss"])
      log(
        f"tune x{mult:g} seed {seed}: loss {r['final_loss']:.4f}, {r['wall_s']:.0f} s"
      )
  best = min(losses, key=lambda m: float(np.mean(losses[m])))
  return {
    "losses": {str(m): v for m, v in losses.items()},
    "best": best,
    "peak": a.peak * best,
    "at_edge": best in (min(a.lr_sweep), max(a.lr_sweep)),
  }


def branches(
  bench: Bench, kept: dict[int, Any], peak: float, log: Callable[[str], None]
) -> list[dict[str, Any]]:
  """From the small run's saved states: each window at each learning-rate
  multiplier for ``--branch-share`` of the budget; the critical batch size."""
  a, seed = bench.args, bench.args.seeds[0]
  length = max(1, round(a.branch_share * bench.total))
  out = []
  for point in sorted(kept):
    stop = min(point + length, bench.total)
    loss: dict[int, dict[str, float]] = {}
    for k in [k for k in a.windows if k <= stop - point]:
      for mult in a.branch_lrs:
        params, state = jax.device_put(kept[point])
        state = with_peak(state, peak * mult)
        r = bench.train(seed, Plan([(point, k)]), params, state, first=point, stop=stop)
        loss.setdefault(k, {})[str(mult)] = r["final_loss"]
    best = {k: min(v.values()) for k, v in loss.items()}
    small = best[a.windows[0]]
    critical = max(k for k, v in best.items() if v <= small + a.tolerance)
    out.append(
      {
        "tokens": point * bench.per,
        "branch_tokens": (stop - point) * bench.per,
        "loss": {str(k): v for k, v in loss.items()},
        "best": {str(k): v for k, v in best.items()},
        "critical_k": critical,
        "critical_tokens": critical * bench.per,
      }
    )
    log(
      f"branch at {point * bench.per:,.0f} tokens: critical window {critical} "
      f"micro-batches; best loss by window "
      + ", ".join(f"{k}: {v:.4f}" for k, v in best.items())
    )
  return out


def summary(runs: list[dict[str, Any]], names: Sequence[str], fixed: Sequence[str]):
  """Per run: losses, updates, walls by seed; the paired differences."""
  by = {n: {r["seed"]: r for r in runs if r["name"] == n} for n in names}
  seeds = sorted(by[names[0]])
  table: dict[str, dict[str, Any]] = {}
  for n in names:
    table[n] = {
      "final_loss": [by[n][s]["final_loss"] for s in seeds],
      "updates": [by[n][s]["updates"] for s in seeds],
      "wall_s": [by[n][s]["wall_s"] for s in seeds],
    }
  best = min(fixed, key=lambda n: float(np.mean(table[n]["final_loss"])))
  for n in names:
    table[n]["minus_best_fixed"] = paired(
      table[n]["final_loss"], table[best]["final_loss"]
    )
    table[n]["minus_small"] = paired(
      table[n]["final_loss"], table["small"]["final_loss"]
    )
  return table, best


def markdown(
  table: dict[str, dict[str, Any]], best: str, windows: dict[str, str]
) -> str:
  lines = [
    "| run | windows (micro-batches) | held-out loss | minus best fixed "
    f"({best}), 95% | minus small, 95% | updates | wall s |",
    "|---|---|---|---|---|---|---|",
  ]
  for n, s in table.items():
    loss = np.asarray(s["final_loss"])
    spread = loss.std(ddof=1) if loss.size > 1 else 0.0
    lines.append(
      f"| {n} | {windows[n]} | {loss.mean():.4f} ± {spread:.4f} "
      f"| {_interval(s['minus_best_fixed'])} | {_interval(s['minus_small'])} "
      f"| {np.mean(s['updates']):,.0f} | {np.mean(s['wall_s']):.0f} |"
    )
  return "\n".join(lines) + "\n"


def describe(args: argparse.Namespace) -> dict[str, str]:
  """Each run's windows, in words."""
  fixed = dict(zip(run_names(args.windows), args.windows, strict=False))
  out = {n: str(k) for n, k in fixed.items()}
  ks = [args.windows[0] * 2**j for j in range(len(args.doublings) + 1)]
  out["doubling"] = " → ".join(
    f"{k}" + (f" at {s:.0%}" if s else "")
    for k, s in zip(ks, [0.0, *args.doublings], strict=True)
  )
  out["switch"] = f"{args.switch[0]} → {args.switch[1]} at 50%"
  scale = optax_accum.WindowController(1, 1).scale if args.scale is None else args.scale
  out["controller"] = f"{args.controller_min}..{args.windows[-1]} (scale {scale:g})"
  return out


STYLE = {"controller": ("k", "-", 2.0), "doubling": ("C1", "-", 1.2)}
STYLE |= {"switch": ("C4", "--", 1.2), "small": ("C0", "-", 1.2)}


def _style(name: str, best: str) -> dict[str, Any]:
  """A run's colour and line: the best fixed window solid green, the other
  fixed windows dotted (grey the large one)."""
  others = {"large": "C7", "fixed-2": "C9", "fixed-8": "C5", "fixed-16": "C7"}
  fallback = ("C2", "-", 1.6) if name == best else (others.get(name, "C8"), ":", 1.2)
  color, line, width = STYLE.get(name, fallback)
  return {"color": color, "ls": line, "lw": width}


def plot(
  runs: list[dict[str, Any]],
  names: Sequence[str],
  best: str,
  cuts: list[dict[str, Any]],
  reference: str,
  per: float,
  paths: list[pathlib.Path],
) -> None:
  """Left: the held-out loss on the curve's rows (mean of seeds; the table's
  final losses are on all the eval rows). Middle: seed ``min``'s windows, the
  smoothed ``B_simple`` and the branches' critical batch. Right: each run's
  loss minus the best fixed window's, per seed, averaged."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  seed = min(r["seed"] for r in runs)
  # A curve's last point is the final loss, on more rows: left out here.
  curve = {(r["name"], r["seed"]): np.asarray(r["curve"])[:-1] for r in runs}
  m = min(len(c) for c in curve.values())
  for n in names:
    mine = [curve[key][:m] for key in curve if key[0] == n]
    mean = np.mean(mine, axis=0)
    axes[0].plot(mean[:, 0] / 1e6, mean[:, 1], label=n, **_style(n, best))
    pairs = [curve[n, s][:m, 1] - curve[best, s][:m, 1] for x, s in curve if x == n]
    axes[2].plot(mean[:, 0] / 1e6, np.mean(pairs, 0), label=n, **_style(n, best))
  low = min(float(c[:, 1].min()) for c in curve.values())
  axes[0].set_ylim(low - 0.05, low + 0.8), axes[0].legend(fontsize=7)
  axes[0].set_xlabel("million tokens"), axes[0].set_ylabel("held-out loss (nats/byte)")
  axes[0].set_title("held-out loss (mean of seeds)", fontsize=9)
  axes[2].axhline(0.0, color="k", lw=0.6)
  axes[2].set_xlabel("million tokens"), axes[2].set_ylim(-0.05, 0.12)
  axes[2].set_title(f"minus {best}'s loss (paired per seed, mean)", fontsize=9)
  axes[2].legend(fontsize=7, ncol=2)
  ax = axes[1]
  for n in ("controller", "doubling", best):
    r = next(r for r in runs if r["name"] == n and r["seed"] == seed)
    w = np.asarray(r["windows"] + [[r["curve"][-1][0], r["windows"][-1][1], 0]])
    style = _style(n, best) | {"ls": "-"}
    ax.step(w[:, 0] / 1e6, w[:, 1] * per, where="post", label=f"{n} window", **style)
  for n, style in (("controller", "-"), (reference, "--")):
    r = next((r for r in runs if r["name"] == n and r["seed"] == seed), None)
    if r is not None and r["records"]:
      rec = np.asarray([(x["tokens"], x["b_simple"]) for x in r["records"]])
      ax.plot(rec[:, 0] / 1e6, rec[:, 1], style, color="C3", lw=0.7, alpha=0.7,
              label=f"smoothed B_simple ({n}'s windows)")  # fmt: skip
  if cuts:
    ax.plot(
      [c["tokens"] / 1e6 for c in cuts],
      [c["critical_tokens"] for c in cuts],
      "kD",
      ms=7,
      label="critical batch (branches)",
    )
  ax.set_yscale("log"), ax.set_xlabel("million tokens"), ax.set_ylabel("tokens")
  ax.set_title(f"window size (seed {seed})", fontsize=9), ax.legend(fontsize=7)
  fig.tight_layout()
  for path in paths:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
  plt.close(fig)


def slim(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """What the JSON keeps: each window's record (``B_simple``, its bounds, the
  target) only for the first seed, the one the plot shows, to 4 digits."""
  first = min(r["seed"] for r in runs)
  out = []
  for r in runs:
    records = [
      {k: float(f"{v:.4g}") for k, v in x.items()}
      for x in (r["records"] if r["seed"] == first else [])
    ]
    out.append(r | {"records": records})
  return out


def replot(path: pathlib.Path, paths: list[pathlib.Path]) -> None:
  """The plot again from a results JSON, without training."""
  saved = json.loads(path.read_text())
  a = saved["meta"]["args"]
  names = run_names(a["windows"])
  reference = dict(zip(a["windows"], names, strict=False))[a["reference"]]
  per = a["size"]["rows"] * a["size"]["length"]
  best = saved["meta"]["best_fixed"]
  plot(saved["runs"], names, best, saved["branches"], reference, per, paths)


def parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add = parser.add_argument
  add("--smoke", action="store_true", help="a tiny model and budget (the tests)")
  add("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
  add("--tune-seeds", nargs="+", type=int, default=[100])
  add("--budget", type=int, default=2048 * 512, help="tokens a run")
  add("--windows", nargs="+", type=int, default=[1, 2, 4, 8, 16], help="micro-batches")
  add("--reference", type=int, default=4, help="micro-batches: the LR's window")
  add("--peak", type=float, default=4e-3, help="learning rate at the reference")
  add("--lr-sweep", nargs="+", type=float, default=[0.25, 0.5, 1, 2, 4, 8])
  add("--doublings", nargs="+", type=float, default=[0.1, 0.25, 0.5])
  add("--switch", nargs=2, type=int, default=[4, 8], help="micro-batches")
  add("--scale", type=float, default=None, help="the controller's (its default)")
  add("--controller-min", type=int, default=None, help="micro-batches (reference)")
  add("--nu-per-item", type=int, default=1, help="adamw_in_items' (0: per update)")
  add("--branch-at", nargs="*", type=float, default=[0.1, 0.3, 0.6])
  add("--branch-share", type=float, default=0.125, help="of the budget")
  add("--branch-lrs", nargs="+", type=float, default=[0.5, 1, 2])
  add("--tolerance", type=float, default=0.02, help="nats")
  add("--eval-share", type=float, default=0.1, help="of the files")
  add("--eval-rows", type=int, default=512)
  add("--curve-rows", type=int, default=96)
  add("--curve-points", type=int, default=12)
  add("--runs", nargs="+", default=None, help="a subset of the runs")
  add("--reuse", default=None, help="results JSON: its tuning and the other runs")
  add("--name", default="batch-ramp", help="the results files' name")
  add("--out", default=str(accumulation.RESULTS))
  add("--docs-plot", default=str(DOCS_PLOT))
  add("--replot", default=None, help="a results JSON: its plot again, no training")
  args = parser.parse_args(argv)
  args.size = FULL
  if args.smoke:
    args.size = SMOKE
    given = set(argv or [])
    smoke = {  # Two window sizes and one evaluation shape: three compiles.
      "--seeds": ("seeds", [0, 1]),
      "--budget": ("budget", 32 * 64),
      "--windows": ("windows", [1, 2]),
      "--reference": ("reference", 1),
      "--lr-sweep": ("lr_sweep", [0.5, 2]),
      "--doublings": ("doublings", [0.5]),
      "--switch": ("switch", [1, 2]),
      "--branch-at": ("branch_at", [0.5]),
      "--branch-lrs": ("branch_lrs", [1.0]),
      "--eval-rows": ("eval_rows", 16),
      "--curve-rows": ("curve_rows", 16),
      "--curve-points": ("curve_points", 4),
      "--peak": ("peak", 1e-2),
    }
    for flag, (key, value) in smoke.items():
      if flag not in given:
        setattr(args, key, value)
  if args.controller_min is None:
    args.controller_min = args.reference
  per = args.size["rows"] * args.size["length"]
  large = args.windows[-1]
  args.budget_mb = max(1, math.ceil(args.budget / per / large)) * large
  return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
  args = parse(argv)
  if args.replot:
    docs = [pathlib.Path(args.docs_plot)] if args.docs_plot else []
    path = pathlib.Path(args.replot)
    replot(path, [path.with_suffix(".png"), *docs])
    return {}
  names = run_names(args.windows)
  reused = json.loads(pathlib.Path(args.reuse).read_text()) if args.reuse else None
  trained = [n for n in names if args.runs is None or n in args.runs]
  chosen = names if reused else trained
  fixed = [n for n in names[: len(args.windows)] if n in chosen]
  reference = dict(zip(names, args.windows, strict=False))
  reference = next(n for n, k in reference.items() if k == args.reference)
  clock = time.perf_counter()
  bench = Bench(args)
  print(
    f"Python {bench.info['python']} stdlib: {bench.info['files']} files, "
    f"{bench.info['bytes']} bytes; {bench.total} micro-batches of {bench.per:.0f} "
    f"tokens a run; compiles {bench.compile_s:.0f} s",
    flush=True,
  )

  def log(line: str) -> None:
    print(f"[{time.perf_counter() - clock:6.0f} s] {line}", flush=True)

  tuned = reused["meta"]["tuning"] if reused else tune(bench, log)
  peak = tuned["peak"]
  log(f"peak learning rate {peak:.2e} (x{tuned['best']:g} of --peak)")
  per_point = sorted({round(s * bench.total) for s in args.branch_at})
  runs, kept = [], {}
  for seed in args.seeds:
    for n in trained:
      params, state = bench.start(seed, peak)
      keep = per_point if (n == "small" and seed == args.seeds[0]) else ()
      r = bench.train(seed, bench.plan(n), params, state, keep=keep)
      kept.update(r.pop("kept"))
      runs.append({"name": n} | r)
      log(
        f"{n} seed {seed}: loss {r['final_loss']:.4f}, {r['updates']} updates, "
        f"{r['wall_s']:.0f} s"
      )
  if reused:  # The runs not trained again, from the earlier run's results.
    runs += [
      r
      for r in reused["runs"]
      if r["name"] in names and r["name"] not in trained and r["seed"] in args.seeds
    ]
  cuts = branches(bench, kept, peak, log) if kept else []
  cuts = cuts or (reused["branches"] if reused else [])
  table, best = summary(runs, chosen, fixed or chosen[:1])
  wall = time.perf_counter() - clock
  device = jax.devices()[0]
  machine = f"{device.platform}-{platform.machine()}"
  command = "python -m benchmarks.batch_ramp " + " ".join(argv or [])
  info = bench.info
  header = (
    f"# Batch-size ramp on the standard library's source, {machine}\n\n"
    f"`{command.strip()}`: {wall / 60:.0f} minutes (compiles {bench.compile_s:.0f} s). "
    f"Python {info['python']}'s standard library, {info['files']['train']} train "
    f"files ({info['bytes']['train']:,} bytes) and {info['files']['eval']} held-out "
    f"files ({info['bytes']['eval']:,} bytes); held-out loss on "
    f"{args.eval_rows * args.size['length']:,} tokens of them. LM: "
    f"{args.size['blocks']} blocks, width {args.size['width']}, micro-batches of "
    f"{bench.per:.0f} tokens; {bench.total * bench.per:,.0f} tokens a run (the "
    f"small window makes {bench.total // args.windows[0]:,} updates); seeds "
    f"{args.seeds}. Peak learning rate {peak:.2e} at the reference window of "
    f"{args.reference} micro-batches (tuned on seeds {args.tune_seeds}: "
    + ", ".join(f"x{m}: {np.mean(v):.4f}" for m, v in tuned["losses"].items())
    + "), times sqrt(window / reference). Loss: mean ± std over seeds; "
    "differences: mean of the per-seed differences [95% interval, t].\n\n"
  )
  text = markdown(table, best, describe(args))
  if "switch" in chosen:
    fixed_k = dict(zip(names, args.windows, strict=False))
    pair = [n for n in names if fixed_k.get(n) in args.switch and n in chosen]
    if len(pair) == 2:
      text += "\nThe switch, paired per seed:\n\n| | mean [95% interval] |\n|---|---|\n"
      for n in pair:
        d = paired(table["switch"]["final_loss"], table[n]["final_loss"])
        table["switch"][f"minus_{n}"] = d
        text += f"| switch minus {n} | {_interval(d)} |\n"
  if cuts:
    text += (
      f"\nBranches from seed {args.seeds[0]}'s small run, "
      f"{cuts[0]['branch_tokens']:,.0f} tokens each, learning rates x"
      f"{args.branch_lrs} of the rule's; critical batch: the largest window within "
      f"{args.tolerance} nats of the small window's best.\n\n"
      "| at tokens | best loss by window (micro-batches) | critical batch (tokens) |\n"
      "|---|---|---|\n"
    )
    for c in cuts:
      best_k = ", ".join(f"{k}: {v:.4f}" for k, v in c["best"].items())
      text += f"| {c['tokens']:,.0f} | {best_k} | {c['critical_tokens']:,.0f} |\n"
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  stem = f"{machine}-{args.name}"
  (out / f"{stem}.md").write_text(header + text)
  meta = {
    "machine": machine,
    "jax": jax.__version__,
    "data": info,
    "wall_s": wall,
    "compile_s": bench.compile_s,
    "best_fixed": best,
    "reused": args.reuse,
    "tuning": tuned,
    "args": {k: v for k, v in vars(args).items()},
  }
  saved = {"meta": meta, "summary": table, "branches": cuts, "runs": slim(runs)}
  (out / f"{stem}.json").write_text(json.dumps(saved, default=float))
  if fixed and "controller" in chosen and "doubling" in chosen:
    paths = [out / f"{stem}.png"] + (
      [pathlib.Path(args.docs_plot)] if args.docs_plot else []
    )
    plot(runs, chosen, best, cuts, reference, bench.per, paths)
  print(header + text, flush=True)
  return table


if __name__ == "__main__":
  main()

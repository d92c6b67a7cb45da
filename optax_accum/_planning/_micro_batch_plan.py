"""``MicroBatchPlan``: what ``plan_micro_batches`` chose, and the step that runs it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from optax_accum._core._checks import batch_leaves
from optax_accum._core._format import size, table
from optax_accum._planning._compile import PlanCandidate
from optax_accum._progress import split_micro_batches
from optax_accum._step import Mode


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
  """What :func:`plan_micro_batches` chose, the table it chose from, and the
  step that runs it.

  ``plan.step`` is the train step whose programs the plan compiled and
  measured: called on the micro-batches of ``plan.split(batch)`` it runs them
  without compiling again. ``plan.window(params, opt_state, batch)`` does one
  update on a global batch that way. ``print(plan)`` shows the table.

  Examples:
    >>> import jax.numpy as jnp, numpy as np, optax, optax_accum
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"]) ** 2), jnp.float32(len(batch["x"]))
    >>> params = {"w": jnp.ones((8, 2))}
    >>> batch = {"x": np.ones((12, 8), np.float32)}
    >>> plan = optax_accum.plan_micro_batches(
    ...   loss_fn, optax.sgd(1e-3), params, batch, memory_budget=2**20,
    ...   compare_modes=False)
    >>> opt_state = plan.step.init(params)
    >>> params, opt_state, metrics = plan.window(params, opt_state, batch)
    >>> int(metrics["update_count"])
    1
  """

  mode: Mode
  global_batch: int
  micro_batch: int
  k: int
  last_micro_batch: int  # Real rows in each window's last micro-batch.
  pad_rows: int  # Zero rows appended to the last micro-batch (pad=True).
  peak_bytes: int  # Predicted per-device peak at this size.
  budget_bytes: int
  params_bytes: int  # Per device, as XLA counts them.
  opt_state_bytes: int  # The inner optimizer's state, per device.
  accumulator_bytes: int  # The accumulator and counters, per device.
  candidates: tuple[PlanCandidate, ...]  # In the order compiled.
  other_mode: PlanCandidate | None  # The other mode at this micro-batch.
  seconds: float  # Wall time of the whole plan.

  @property
  def chosen(self) -> PlanCandidate:
    return next(c for c in self.candidates if c.micro_batch == self.micro_batch)

  @property
  def compile_seconds(self) -> float:
    return sum(c.compile_seconds for c in self.candidates)

  @property
  def step(self) -> Any:
    """The :class:`TrainStep` the plan compiled at the chosen size, in its mode
    (``plan.step.optimizer`` is its ``MultiSteps``, with ``k = plan.k``)."""
    return self.chosen.step

  def window(
    self, params: Any, opt_state: Any, batch: Any, rng: Any = None
  ) -> tuple[Any, Any, Any]:
    """One update on a global batch: ``split(batch)`` fed to :attr:`step`.

    Returns ``(params, opt_state, metrics)`` after the window's last call.
    """
    calls = self.split(batch)
    for micro_batches in [calls] if self.mode == "scan" else calls:
      params, opt_state, metrics = self.step(params, opt_state, micro_batches, rng)
    return params, opt_state, metrics

  def split(self, batch: Any) -> Any:
    """Cuts a global batch of ``global_batch`` rows as the plan compiled it.

    Streaming: a list of ``k`` micro-batches, consecutive blocks of
    ``micro_batch`` rows; the last holds the remaining rows, or is padded with
    zero rows to ``micro_batch`` when the plan pads. NumPy leaves stay on the
    host; a jax array's blocks are placed with its sharding (the plan counts
    one micro-batch on the device at a time: a window kept on the device must
    fit in the headroom). Scan: one tree with a leading axis of ``k``
    micro-batches (:func:`split_micro_batches`, after padding).
    """
    leaves = batch_leaves(batch)
    rows = {np.shape(leaf)[0] for _, leaf in leaves}
    if rows != {self.global_batch}:
      raise ValueError(
        f"`batch` must have the plan's {self.global_batch} rows, got leading "
        f"sizes {sorted(rows)}."
      )
    if self.pad_rows:
      batch = jax.tree.map(lambda x: _pad_rows(x, self.pad_rows), batch)
    if self.mode == "scan":
      return split_micro_batches(batch, self.k)
    return [
      jax.tree.map(
        lambda x, i=i: _placed_like(
          x[i * self.micro_batch : (i + 1) * self.micro_batch], x
        ),
        batch,
      )
      for i in range(self.k)
    ]

  def __str__(self) -> str:
    return "\n".join(
      [
        *self._summary_lines(),
        *table(*self._candidate_rows()),
        f"  {len(self.candidates)} sizes compiled in {self.seconds:.1f} s "
        "(peak = arguments + outputs - donated aliases + temporaries, + the "
        "optimizer state for accumulate)",
      ]
    )

  def _summary_lines(self) -> list[str]:
    """The chosen size, its peak against the budget, and the other mode's peak."""
    last = (
      f"{self.last_micro_batch} rows + {self.pad_rows} zero rows"
      if self.pad_rows
      else f"{self.last_micro_batch} rows"
    )
    lines = [
      f"micro-batch plan ({self.mode}): {self.micro_batch} rows x k={self.k} for "
      f"a global batch of {self.global_batch} (last micro-batch: {last})",
      f"  peak {size(self.peak_bytes)} per device, budget {size(self.budget_bytes)}"
      f"; resident: params {size(self.params_bytes)}, optimizer state "
      f"{size(self.opt_state_bytes)}, accumulator {size(self.accumulator_bytes)}",
    ]
    if self.other_mode is not None:
      lines.append(self._other_mode_line(self.other_mode))
    return lines

  def _other_mode_line(self, other: PlanCandidate) -> str:
    smaller = self.mode if self.chosen.peak_bytes <= other.peak_bytes else other.mode
    stacked = ""
    if other.mode == "scan":
      padded = other.k * other.micro_batch != self.global_batch
      stacked = f" (stacked batch{', padded,' if padded else ''} included)"
    return (
      f"  {other.mode} at {other.micro_batch} rows x k={other.k}: "
      f"{size(other.peak_bytes)}{stacked}; {smaller} needs less"
    )

  def _candidate_rows(self) -> tuple[list[list[str]], list[str]]:
    """The table of candidates by size, and the mark of the chosen one."""
    chosen = self.chosen
    names = [
      name
      for name in ("accumulate", "update", "scan")
      if any(p.program == name for c in self.candidates for p in c.programs)
    ]
    rows = [["micro", "k", "last", *names, "peak", "fits", "compile s"]]
    marks = [""]
    for c in sorted(self.candidates, key=lambda c: c.micro_batch):
      by_name: dict[str, str] = {p.program: size(p.peak_bytes) for p in c.programs}
      rows.append(
        [
          str(c.micro_batch),
          str(c.k),
          str(c.last_micro_batch),
          *(by_name.get(name, "-") for name in names),
          size(c.peak_bytes),
          "yes" if c.fits else "no",
          f"{c.compile_seconds:.2f}",
        ]
      )
      marks.append("  <- chosen" if c is chosen else "")
    return rows, marks


# -- splitting a batch -------------------------------------------------------


def _pad_rows(x: Any, rows: int) -> Any:
  zeros_shape = (rows, *np.shape(x)[1:])
  if isinstance(x, jax.Array):
    padded = jnp.concatenate([x, jnp.zeros(zeros_shape, x.dtype)])
    return _placed_like(padded, x)
  return np.concatenate([np.asarray(x), np.zeros(zeros_shape, np.asarray(x).dtype)])


def _placed_like(part: Any, whole: Any) -> Any:
  """``part`` of a jax array, placed with the whole array's sharding."""
  if isinstance(whole, jax.Array) and isinstance(whole.sharding, NamedSharding):
    return jax.device_put(part, whole.sharding)
  return part

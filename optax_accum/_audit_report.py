"""``AuditReport``: what ``audit`` measured and found, and how it prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from optax_accum import _report
from optax_accum._audit_runs import Path

FAILURES = {
  "F1": "mean of per-micro-batch means",
  "F3": "schedule or optimizer stepped on micro-steps",
  "F4": "off-by-one window",
  "F6": "gradients dropped at the window boundary",
  "F7": "params frozen while the optimizer state advances",
  "other": "any other difference from the whole batch",
}


@dataclasses.dataclass
class Verdict:
  """One failure's finding: ``status`` is ``"ok"``, ``"FOUND"`` or ``"n/a"``."""

  status: str
  detail: str
  fix: str = ""


@dataclasses.dataclass
class AuditReport:
  """What :func:`audit` measured; ``print(report)`` shows it as a table.

  Attributes:
    setup: What ran on the accumulated side.
    k: Micro-batches per update.
    tokens: Weight (tokens) of each micro-batch of the first window.
    mean_of_means_bias: Relative error, on this batch, of the uniform mean of
      micro-batch mean gradients against the whole-batch gradient: what F1
      would cost here.
    grad_error: Relative error of the first window's gradient that the setup
      applies, against the whole batch (measured with ``optax.sgd(1.0)``).
    grad_fit: What that gradient is (see ``GradientFit.describe``).
    grad_scale: The multiple ``c`` in the fit ``applied = c * candidate``.
    micro_batch_weights: The weight the applied gradient gives each
      micro-batch's gradient (least squares; the whole batch gives each its
      share of the tokens), or ``None`` when it is no combination of them.
    params_diff: Relative params difference after ``steps`` updates.
    rounding_diff: The same between two exact whole-batch runs that sum in a
      different order: rounding alone.
    rounding_leaves: Leaves whose whole-batch gradient is rounding noise (not
      compared: an optimizer like Adam turns that noise into full steps).
    finite: Whether the accumulated run's params stayed finite.
    reference_finite: Whether the whole-batch run's did.
    lr: Each injected learning rate (by where it sits in the optimizer state)
      at each window end, accumulated side.
    lr_reference: The same at each whole-batch update.
    changed: For each micro-step, whether the params changed.
    expected_changes: Where they should change: the last micro-step of each
      window whose whole-batch update changed the params.
    resumed: Whether params changed on the micro-step before a simulated
      restart (the setup built again, one micro-step into a window) and on
      each of the ``2 k`` after it.
    tolerance: Relative error above which a difference counts.
    verdicts: Failure id to :class:`Verdict`.
  """

  setup: str
  k: int
  tokens: list[float]
  mean_of_means_bias: float
  grad_error: float
  grad_fit: str
  grad_scale: float
  micro_batch_weights: list[float] | None
  params_diff: float
  rounding_diff: float
  rounding_leaves: list[str]
  finite: bool
  reference_finite: bool
  lr: dict[str, list[float]]
  lr_reference: dict[str, list[float]]
  changed: list[bool]
  expected_changes: list[bool]
  resumed: list[bool]
  tolerance: float
  verdicts: dict[str, Verdict] = dataclasses.field(default_factory=dict)

  @property
  def ok(self) -> bool:
    """No failure found and the run matches the whole batch."""
    return all(v.status != "FOUND" for v in self.verdicts.values())

  def found(self) -> set[str]:
    """The ids of the failures found."""
    return {f for f, v in self.verdicts.items() if v.status == "FOUND"}

  def _params_diff(self) -> str:
    text = f"{self.params_diff:.2e}"
    if self.rounding_diff > self.tolerance:  # Say why such a difference is fine.
      text += f" (rounding alone: {self.rounding_diff:.1e})"
    return text

  def __str__(self) -> str:
    lines = [
      f"accumulation audit of {self.setup}: k={self.k}, "
      f"{len(self.changed) // self.k} updates against the whole batch -> "
      f"{'OK' if self.ok else 'PROBLEMS FOUND'}",
      _report.row("tokens per micro-batch", [round(t) for t in self.tokens]),
      _report.row("mean-of-means bias here", f"{self.mean_of_means_bias:.2e}"),
      _report.row("first-window gradient", self.grad_fit),
      _report.row("params diff after updates", self._params_diff()),
    ]
    if self.rounding_leaves:
      lines.append(
        _report.row(
          "not compared",
          f"{', '.join(self.rounding_leaves)}: whole-batch gradient at rounding level",
        )
      )
    for where, values in self.lr.items():
      of = f" of {where}" if where else ""
      lines.append(_report.row(f"lr{of} (yours)", _report.short(values)))
      lines.append(
        _report.row(f"lr{of} (reference)", _report.short(self.lr_reference[where]))
      )
    lines.append(_report.row("params changed at", _report.marks(self.changed)))
    lines.append(
      _report.row("expected changes at", _report.marks(self.expected_changes))
    )
    if self.resumed:
      marks = f"{_report.marks(self.resumed[:1])}|{_report.marks(self.resumed[1:])}"
      lines.append(_report.row("after a restart mid-window", marks))
    for failure, verdict in self.verdicts.items():
      name = FAILURES[failure]
      lines.append(f"  {failure:<5} {name:<48} {verdict.status:<5} {verdict.detail}")
      if verdict.status == "FOUND":
        lines.append(f"        fix: {verdict.fix}")
    return "\n".join(lines)


_WRAPPERS = {"hyperparams", "learning_rate", "inner_state", "inner_states"}


def _where(path: Path) -> str:
  """A learning rate's place in the optimizer state, for people: ``head`` for
  a ``multi_transform`` group, ``[1]`` for a ``chain`` member, ``""`` alone."""
  return ".".join(f"[{p}]" if p.isdigit() else p for p in path if p not in _WRAPPERS)


def lr_labels(paths: Sequence[Path]) -> dict[Path, str]:
  """:func:`_where` for each path, or the whole path where two would clash."""
  short = [_where(path) for path in paths]
  return {
    path: label if short.count(label) == 1 else ".".join(path)
    for path, label in zip(paths, short, strict=True)
  }

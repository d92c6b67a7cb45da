"""``AuditReport``: what ``audit`` measured and found, and how it prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from optax_accum._audit._runs import Path
from optax_accum._core import _format

FAILURES = {
  "F1": "mean of per-micro-batch means",
  "F3": "schedule or optimizer stepped on micro-steps",
  "F4": "off-by-one window",
  "F6": "gradients dropped at the window boundary",
  "F7": "params frozen while the optimizer state advances",
  "weight": "weight: not the count the loss divides by",
  "terms": "loss term weighted by the wrong count",
  "F10": "loss that couples the batch, per micro-batch",
  "other": "any other difference from the whole batch",
}
FIXES = {
  "F1": "pass each micro-batch's {count}: optax_accum.MultiSteps(...).update("
  "grads, state, params, weight={var})",
  "F3": "run the optimizer once per window (optax_accum.MultiSteps calls it only "
  "on the micro-step that ends one), and count schedules in updates: "
  "optax_accum.progress_schedule(schedule)",
  "F3 chained": "put what follows the accumulator inside it, so it runs once per "
  "update: optax_accum.MultiSteps(optax.chain(opt, optax.scale_by_schedule(s)), "
  "k), or inject the schedule: optax_accum.progress_schedule(schedule)",
  "F4": "let the optimizer state decide window ends: optax_accum.make_train_step",
  "F6": "add every micro-batch into the window's sum, never overwrite it: "
  "optax_accum.MultiSteps",
  "F7": "apply every update the optimizer returns, in one step function that "
  "reads the window's end from the optimizer state: optax_accum.make_train_step",
  "terms": "divide each term's window sum by that term's own total weight: "
  "optax_accum.MultiSteps(opt, k, terms=(...)) with loss_fn returning {name: "
  "(value, weight)}",
  "F10": "the loss couples the window's examples (a contrastive loss, a "
  "balance over the batch): take it over the whole window in two passes, "
  "make_train_step(optax_accum.CoupledLoss(represent, window_loss), opt, "
  'mode="scan") (docs/coupled.md)',
  "terms declared": "return each term as the mean over its own items, and their "
  "count as its weight (a value computed once per micro-batch: weight 1)",
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
    tokens: ``loss_fn``'s weight of each micro-batch of the first window
      (tokens, or whatever it counts: ``weight_name``).
    mean_of_means_bias: Relative error, on this batch, of the uniform mean of
      micro-batch mean gradients against the whole-batch gradient: what F1
      would cost here.
    grad_error: Relative error of the first window's gradient that the setup
      applies, against the whole batch (measured by the probe: your optimizer
      with its updates replaced by the gradient); NaN where not measured.
    grad_fit: What that gradient is (see ``GradientFit.describe``).
    grad_scale: The multiple ``c`` in the fit ``applied = c * candidate``.
    micro_batch_weights: The weight the applied gradient gives each
      micro-batch's gradient (least squares; the whole batch gives each its
      share of the tokens), or ``None`` when it is no combination of them.
    params_diff: Relative params difference after the last update compared.
    rounding_diff: The same between two exact whole-batch runs that sum in a
      different order: rounding alone.
    rounding_leaves: Leaves whose whole-batch gradient is rounding noise (not
      compared: an optimizer like Adam turns that noise into full steps).
    finite: Whether the accumulated run's params stayed finite.
    reference_finite: Whether the whole-batch run's did.
    lr: Each injected learning rate (by where it sits in the optimizer state)
      at each window end compared, accumulated side.
    lr_reference: The same at each whole-batch update compared.
    changed: For each micro-step before the restart, whether params changed.
    expected_changes: Where they should change: the last micro-step of each
      window whose whole-batch update changed the params.
    resumed: Whether params changed on the micro-step before a simulated
      restart (the setup built again, one micro-step into update
      ``steps + 1``) and on each of the ``2 k`` after it.
    expected_resumed: Where they should, as ``expected_changes``.
    applied: For each micro-step before the restart, whether the loop applied
      an update: whether the probe's params changed (the setup's own where
      there is no probe). Unlike ``changed``, this does not depend on the
      learning rate.
    expected_applied: Where windows end with a nonzero whole-batch gradient.
    applied_resumed: ``applied`` from the micro-step before the restart on.
    expected_applied_resumed: ``expected_applied`` for the same micro-steps.
    updates_compared: Updates whose params and learning rates were compared:
      ``steps + 2`` where the windows after the restart line up, else ``steps``.
    tolerance: Relative error above which a difference counts.
    verdicts: Failure id to :class:`Verdict` (``terms`` only where ``loss_fn``
      returns loss terms).
    term_weights: With loss terms, each term's weight in each micro-batch of
      the first window, by name (``tokens`` holds the first weighted term's).
    term_coefficients: The coefficient the applied gradient gives each term in
      each micro-batch (least squares; the window's objective gives
      ``w_ti / W_t``), where measured.
    weight_name: What ``loss_fn``'s weight counts, as far as the batch's
      shapes tell: ``"tokens"``, ``"sequences"`` (a whole number, at most one
      a row), ``"rows"``, ``"positions"`` or ``"weight"``.
    whole_batch_weighting: The count the whole batch weighs the micro-batches
      by (``"tokens"``, ``"rows or positions"``, ...), or ``"sum"`` (1 each,
      not normalised: a loss divided by a constant or not at all),
      ``"fitted"`` (in proportion to none of the usual counts) or
      ``"coupled"`` (no combination of them); empty with loss terms.
    whole_batch_weights: The whole batch's coefficient of each micro-batch's
      gradient (``None`` where coupled or with loss terms).
    as_declared: Whether that is the weighting the setup is told (by
      ``loss_fn``'s weight; 1 each with ``grad_reduction="window_mean"``).
    whole_batch_weighs: It in words, with the counts.
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
  expected_resumed: list[bool]
  applied: list[bool]
  expected_applied: list[bool]
  applied_resumed: list[bool]
  expected_applied_resumed: list[bool]
  updates_compared: int
  tolerance: float
  verdicts: dict[str, Verdict] = dataclasses.field(default_factory=dict)
  term_weights: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  term_coefficients: dict[str, list[float]] | None = None
  weight_name: str = "tokens"
  whole_batch_weighting: str = ""
  whole_batch_weights: list[float] | None = None
  as_declared: bool = True
  whole_batch_weighs: str = ""

  @property
  def ok(self) -> bool:
    """No failure found and the run matches the whole batch."""
    return all(v.status != "FOUND" for v in self.verdicts.values())

  def found(self) -> set[str]:
    """The ids of the failures found."""
    return {f for f, v in self.verdicts.items() if v.status == "FOUND"}

  def _weights(self) -> list[str]:
    if not self.term_weights:
      weights = [int(w) if float(w).is_integer() else round(w, 3) for w in self.tokens]
      lines = [_format.row(f"{self.weight_name} per micro-batch", weights)]
      if not self.as_declared and self.whole_batch_weighs:
        lines.append(_format.row("the whole batch", self.whole_batch_weighs))
      return lines
    return [
      _format.row(
        f"weight of {name!r}",
        [int(w) if float(w).is_integer() else round(w, 3) for w in weights],
      )
      for name, weights in self.term_weights.items()
    ]

  def _params_diff(self) -> str:
    text = f"{self.params_diff:.2e}"
    if self.rounding_diff > self.tolerance:  # Say why such a difference is fine.
      text += f" (rounding alone: {self.rounding_diff:.1e})"
    return text

  def _restart(self) -> str:
    """Where the restart was, and whether the updates after it were compared."""
    steps = len(self.changed) // self.k
    text = f"one micro-step into update {steps + 1} (|), the setup built again"
    if self.updates_compared > steps:
      return text
    late = self.applied_resumed == [False, *self.expected_applied_resumed[:-1]]
    why = ": windows end one micro-step late" if late else ""
    return f"{text}{why}: updates {steps + 1}-{steps + 2} not compared"

  def _marks(self) -> list[str]:
    def both(fresh: list[bool], resumed: list[bool]) -> str:
      restart = f"{_format.marks(resumed[:1])}|{_format.marks(resumed[1:])}"
      return f"{_format.marks(fresh)} {restart}"

    lines = [
      _format.row("params changed at", both(self.changed, self.resumed)),
      _format.row(
        "expected changes at", both(self.expected_changes, self.expected_resumed)
      ),
    ]
    if (self.applied, self.applied_resumed) != (self.changed, self.resumed):
      lines.append(
        _format.row("updates applied at", both(self.applied, self.applied_resumed))
      )
    return [*lines, _format.row("restart", self._restart())]

  def __str__(self) -> str:
    lines = [
      f"accumulation audit of {self.setup}: k={self.k}, updates "
      f"1-{self.updates_compared} against the whole batch -> "
      f"{'OK' if self.ok else 'PROBLEMS FOUND'}",
      *self._weights(),
      _format.row("mean-of-means bias here", f"{self.mean_of_means_bias:.2e}"),
      _format.row("first-window gradient", self.grad_fit),
      _format.row("params diff after updates", self._params_diff()),
    ]
    if self.rounding_leaves:
      lines.append(
        _format.row(
          "not compared",
          f"{', '.join(self.rounding_leaves)}: whole-batch gradient at rounding level",
        )
      )
    for where, values in self.lr.items():
      of = f" of {where}" if where else ""
      lines.append(_format.row(f"lr{of} (yours)", _format.short(values)))
      lines.append(
        _format.row(f"lr{of} (reference)", _format.short(self.lr_reference[where]))
      )
    lines += self._marks()
    for failure, verdict in self.verdicts.items():
      name = FAILURES[failure]
      lines.append(f"  {failure:<6} {name:<48} {verdict.status:<5} {verdict.detail}")
      if verdict.status == "FOUND":
        lines.append(f"         fix: {verdict.fix}")
    return "\n".join(lines)


_WRAPPERS = {"hyperparams", "learning_rate", "inner_state", "inner_states"}


def place_in_state(path: Path) -> str:
  """A learning rate's place in the optimizer state, for people: ``head`` for
  a ``multi_transform`` group, ``[1]`` for a ``chain`` member, ``""`` alone."""
  return ".".join(f"[{p}]" if p.isdigit() else p for p in path if p not in _WRAPPERS)


def lr_labels(paths: Sequence[Path]) -> dict[Path, str]:
  """:func:`place_in_state` for each path, or the whole path where two would clash."""
  short = [place_in_state(path) for path in paths]
  return {
    path: label if short.count(label) == 1 else ".".join(path)
    for path, label in zip(paths, short, strict=True)
  }

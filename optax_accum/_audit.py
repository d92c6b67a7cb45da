"""``audit``: check an accumulation setup against training on the whole batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum import _checks
from optax_accum._audit_compare import (
  GradientFit,
  ParamsComparison,
  compare_params,
  fit_gradient,
  leaf_names,
  rounding_level_leaves,
)
from optax_accum._audit_runs import (
  Path,
  Reference,
  SetupRun,
  copy_arrays,
  f32,
  gradient_fn,
  gradient_probe,
  recombined,
  setup_run,
  whole_batch_run,
)
from optax_accum._audit_setups import Accumulation, check_loss_fn, resolve_setup
from optax_accum._batching import split_micro_batches

__all__ = ["Accumulation", "AuditReport", "Verdict", "audit"]

FAILURES = {
  "F1": "mean of per-micro-batch means",
  "F3": "schedule or optimizer stepped on micro-steps",
  "F4": "off-by-one window",
  "F6": "gradients dropped at the window boundary",
  "F7": "params frozen while the optimizer state advances",
  "other": "any other difference from the whole batch",
}
FIXES = {
  "F1": "pass each micro-batch's token count: optax_accum.MultiSteps(...).update("
  "grads, state, params, weight=n_tokens)",
  "F3": "run the optimizer once per window (optax_accum.MultiSteps calls it only "
  "on the micro-step that ends one), and count schedules in updates: "
  "optax_accum.progress_schedule(schedule)",
  "F4": "let the optimizer state decide window ends: optax_accum.make_train_step",
  "F6": "add every micro-batch into the window's sum, never overwrite it: "
  "optax_accum.MultiSteps",
  "F7": "apply every update the optimizer returns, in one step function that "
  "reads the window's end from the optimizer state: optax_accum.make_train_step",
}
#: Relative difference between learning rates that counts.
LR_TOLERANCE = 1e-5


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
      _row("tokens per micro-batch", [round(t) for t in self.tokens]),
      _row("mean-of-means bias here", f"{self.mean_of_means_bias:.2e}"),
      _row("first-window gradient", self.grad_fit),
      _row("params diff after updates", self._params_diff()),
    ]
    if self.rounding_leaves:
      lines.append(
        _row(
          "not compared",
          f"{', '.join(self.rounding_leaves)}: whole-batch gradient at rounding level",
        )
      )
    for where, values in self.lr.items():
      of = f" of {where}" if where else ""
      lines.append(_row(f"lr{of} (yours)", _short(values)))
      lines.append(_row(f"lr{of} (reference)", _short(self.lr_reference[where])))
    lines.append(_row("params changed at", _marks(self.changed)))
    lines.append(_row("expected changes at", _marks(self.expected_changes)))
    if self.resumed:
      marks = f"{_marks(self.resumed[:1])}|{_marks(self.resumed[1:])}"
      lines.append(_row("after a restart mid-window", marks))
    for failure, verdict in self.verdicts.items():
      name = FAILURES[failure]
      lines.append(f"  {failure:<5} {name:<48} {verdict.status:<5} {verdict.detail}")
      if verdict.status == "FOUND":
        lines.append(f"        fix: {verdict.fix}")
    return "\n".join(lines)


def _row(title: str, value: Any) -> str:
  return f"  {title:<26} {value}"


def _short(values: Sequence[float]) -> str:
  return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def _marks(flags: Sequence[bool]) -> str:
  return "".join("U" if flag else "." for flag in flags)


_WRAPPERS = {"hyperparams", "learning_rate", "inner_state", "inner_states"}


def _where(path: Path) -> str:
  """A learning rate's place in the optimizer state, for people: ``head`` for
  a ``multi_transform`` group, ``[1]`` for a ``chain`` member, ``""`` alone."""
  return ".".join(f"[{p}]" if p.isdigit() else p for p in path if p not in _WRAPPERS)


def _labels(paths: Sequence[Path]) -> dict[Path, str]:
  """:func:`_where` for each path, or the whole path where two would clash."""
  short = [_where(path) for path in paths]
  return {
    path: label if short.count(label) == 1 else ".".join(path)
    for path, label in zip(paths, short, strict=True)
  }


def audit(
  loss_fn: Callable[..., Any],
  optimizer: optax.GradientTransformation,
  params: optax.Params,
  batch: Any,
  *,
  k: int,
  steps: int = 3,
  split: Callable[[Any, int], Sequence[Any]] | None = None,
  accumulation: Accumulation | None = None,
  has_aux: bool = False,
  tolerance: float = 1e-4,
) -> AuditReport:
  """Runs an accumulation setup and the whole batch side by side, and compares.

  The whole-batch side applies ``optimizer`` once per batch. The accumulated
  side feeds the same data as ``k`` micro-batches per update through your
  setup: ``accumulation`` if given; the usual loop around ``optimizer`` if it
  is itself an accumulator (``optax.MultiSteps`` or
  :class:`optax_accum.MultiSteps`, whose inner optimizer then runs on the
  whole batch); otherwise :class:`optax_accum.MultiSteps` in
  :func:`optax_accum.make_train_step`. The setup runs

  - around ``optax.sgd(1.0)`` on float32 copies of the params for one window,
    which makes the gradient it applies visible;
  - around ``optimizer`` for ``steps`` updates, then one micro-step more, then
    built again (as a restarted process would) and fed ``2 k`` more
    micro-batches from the params and state it had: updates must go on.

  A second whole-batch run sums the micro-batch gradients (token-weighted)
  instead of taking the batch's own: the two differ by rounding only, which
  sets how close each leaf of the setup's params must end.

  Every run gets its own copy of ``params``, so a setup that donates its
  buffers is fine.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, weight)``, the token-mean loss
      and the number of tokens, or ``(loss, (weight, aux))`` with ``has_aux``.
    optimizer: The optimizer the whole batch would use, or your accumulator
      around it (``optax.MultiSteps(opt, k)``). Learning rates injected with
      ``optax.inject_hyperparams`` are compared at every update, in every
      branch; step counts (``count``) are compared whether injected or not.
    params: Initial params (not modified).
    batch: One batch, reused for every update, or a ``list`` of ``steps``
      batches; leaves have a leading batch axis.
    k: Micro-batches per update.
    steps: Updates to run.
    split: ``split(batch, k) -> micro-batches``; defaults to
      :func:`split_micro_batches`.
    accumulation: ``accumulation(optimizer, k) -> (init, step)``, your setup:
      ``init(params) -> state`` and ``step(params, state, micro_batch) ->
      (params, state)``, called once per micro-batch.
    has_aux: Whether ``loss_fn`` returns auxiliary outputs.
    tolerance: Relative error above which a difference counts (raised to the
      precision of low-precision params for the trajectory).

  Returns:
    An :class:`AuditReport`; ``report.ok`` is a bool.

  Raises:
    ValueError: For bad arguments, a ``loss_fn`` that does not return ``(loss,
      weight)``, an accumulator passed with ``accumulation`` or inside another
      transformation, or a setup that returns params of another structure.
  """
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"`k` must be an int >= 1, got {k!r}.")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"`steps` must be an int >= 1, got {steps!r}.")
  batches = list(batch) if isinstance(batch, list) else [batch] * steps
  if len(batches) != steps:
    raise ValueError(f"`batch` holds {len(batches)} batches for steps={steps}.")
  if split is None:

    def split(b: Any, k: int) -> list[Any]:
      stacked = split_micro_batches(b, k)
      return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(k)]

  micro = [list(split(b, k)) for b in batches]
  if len(micro[0]) != k:
    raise ValueError(f"`split` returned {len(micro[0])} micro-batches for k={k}.")
  check_loss_fn(loss_fn, has_aux, params, micro[0][0])
  has_aux = bool(has_aux)
  setup = resolve_setup(loss_fn, has_aux, optimizer, params, k, accumulation)

  # The batch itself: token counts and what F1 would cost on it (float32).
  params32 = f32(params)
  grad_fn = gradient_fn(loss_fn, has_aux)
  whole_grad, _ = grad_fn(params32, batches[0])
  pairs = [grad_fn(params32, m) for m in micro[0]]
  micro_grads = [g for g, _ in pairs]
  tokens = [float(w) for _, w in pairs]
  if not sum(tokens) > 0:
    raise ValueError(f"The first batch holds no tokens: weights {tokens}.")
  resummed_grad = recombined(micro_grads, tokens, params32)
  uniform = jax.tree.map(lambda *g: sum(g) / k, *micro_grads)

  probe = gradient_probe(setup.accumulation, k, params32, micro[0])
  fit = fit_gradient(probe.applied, whole_grad, micro_grads, tokens, tolerance)

  reference = whole_batch_run(grad_fn, setup.optimizer, params, batches)
  resummed = whole_batch_run(grad_fn, setup.optimizer, params, batches, micro=micro)
  run = setup_run(
    setup.accumulation,
    setup.optimizer,
    k,
    copy_arrays(params),
    micro,
    reference,
    resume=True,
  )
  _checks.check_tree_matches(
    run.params[0],
    reference.params[0],
    name="params your step returns",
    ref_name="the params given",
  )
  lowest = min(jnp.finfo(jnp.result_type(x)).eps for x in jax.tree.leaves(params))
  trajectory_tol = max(tolerance, 32 * float(lowest))
  skip = rounding_level_leaves(whole_grad, resummed_grad)
  comparison = compare_params(
    reference.params, resummed.params, run.params, skip, trajectory_tol
  )
  expected = [c for update in reference.changed for c in [False] * (k - 1) + [update]]
  names = leaf_names(params)
  labels = _labels(list(reference.learning_rates))
  report = AuditReport(
    setup=setup.name,
    k=k,
    tokens=tokens,
    mean_of_means_bias=_rel(uniform, whole_grad),
    grad_error=fit.error,
    grad_fit=fit.describe,
    grad_scale=fit.scale,
    micro_batch_weights=fit.coefficients,
    params_diff=comparison.diff,
    rounding_diff=comparison.rounding,
    rounding_leaves=[names[i] for i in skip],
    finite=run.nonfinite_at is None,
    reference_finite=reference.nonfinite_at is None,
    lr={
      labels[p]: [v[0] for v in values if v] for p, values in run.learning_rates.items()
    },
    lr_reference={labels[p]: v for p, v in reference.learning_rates.items()},
    changed=run.changed,
    expected_changes=expected,
    resumed=run.resumed,
    tolerance=trajectory_tol,
  )
  report.verdicts = _verdicts(
    report, fit, probe.changed, comparison, reference, run, tolerance, steps
  )
  return report


def _rel(a: Any, b: Any) -> float:
  diff = jax.tree.map(jnp.subtract, f32(a), f32(b))
  return float(optax.tree.norm(diff) / jnp.maximum(optax.tree.norm(f32(b)), 1e-30))


def _window_verdicts(r: AuditReport) -> tuple[Verdict, Verdict, bool]:
  """F7 and F4 from where params changed; and whether the windows line up."""
  k = r.k
  if not any(r.expected_changes):
    na = Verdict("n/a", "the whole-batch run never changed the params")
    return na, na, False
  if not any(r.changed):
    return (
      Verdict("FOUND", "params never changed", FIXES["F7"]),
      Verdict("n/a", "no update to place"),
      False,
    )
  pairs = zip(r.changed, r.expected_changes, strict=True)
  mismatch = [i for i, (a, b) in enumerate(pairs) if a != b]
  if mismatch:
    i = mismatch[0]
    what = "changed" if r.changed[i] else "did not change"
    f4 = Verdict(
      "FOUND",
      f"params {what} after micro-step {i + 1}; windows end every {k}",
      FIXES["F4"],
    )
  else:
    f4 = Verdict("ok", "updates at window ends")
  after = r.resumed[1:]
  if r.resumed and not any(after):
    f7 = Verdict(
      "FOUND",
      f"params froze after a restart one micro-step into a window: no update in "
      f"the {len(after)} micro-steps after it (the loop's own micro-step count and "
      "the optimizer state no longer agree, as after a resumed run or a skipped "
      "batch)",
      FIXES["F7"],
    )
  elif r.resumed and sum(after) > len(after) // k + 1:
    f7 = Verdict("ok", "params changed")
    f4 = Verdict(
      "FOUND",
      f"after a restart one micro-step into a window params changed {sum(after)} "
      f"times in {len(after)} micro-steps",
      FIXES["F4"],
    )
  else:
    f7 = Verdict("ok", "params changed, and again after a restart mid-window")
  return f7, f4, not mismatch


def _gradient_verdicts(
  r: AuditReport, fit: GradientFit, probe_changed: list[bool]
) -> tuple[Verdict, Verdict, str | None]:
  """F1 and F6 from the probe window; and an unexplained gradient problem."""
  k = r.k
  if probe_changed != [False] * (k - 1) + [True]:
    na = Verdict(
      "n/a",
      f"the first window changed params at {_marks(probe_changed)}, not at its end",
    )
    return na, na, None
  if fit.kind == "whole":
    return (
      Verdict("ok", f"gradient matches the whole batch ({fit.error:.1e})"),
      Verdict("ok", "every micro-batch is in the gradient"),
      None,
    )
  off = f"gradient off by {fit.error:.1e}"
  if fit.kind in ("last", "dropped"):
    return (
      Verdict("n/a", "micro-batches are missing from the gradient"),
      Verdict("FOUND", f"{off}: it is {fit.what}", FIXES["F6"]),
      None,
    )
  if fit.kind == "uniform":
    lo, hi = min(r.tokens), max(r.tokens)
    return (
      Verdict(
        "FOUND",
        f"{off}: it is {fit.what} (tokens {lo:.0f}-{hi:.0f})",
        FIXES["F1"],
      ),
      Verdict("ok", "every micro-batch is in the gradient"),
      None,
    )
  na = Verdict("n/a", "the gradient differs in another way")
  return na, na, f"the window {off}: {fit.what}"


def _schedule_verdict(reference: Reference, run: SetupRun, steps: int) -> Verdict:
  """F3 from every injected learning rate and every step count."""
  labels = _labels(list(reference.learning_rates))
  problems = []
  for path, ref_values in reference.learning_rates.items():
    for n, (mine, ref) in enumerate(
      zip(run.learning_rates[path], ref_values, strict=True)
    ):
      bad = [v for v in mine if abs(v - ref) > LR_TOLERANCE * max(abs(ref), 1e-12)]
      if bad:
        where = f" of {labels[path]}" if labels[path] else ""
        problems.append(
          f"learning rate{where} is {bad[0]:.3g} at update {n + 1} (whole batch: "
          f"{ref:.3g})"
        )
        break
  counted = {
    path: (max(run.counts[path]), ref[0])
    for path, ref in reference.counts.items()
    if run.counts.get(path)
  }
  fast = {path: c for path, c in counted.items() if c[0] > c[1]}
  if fast:
    count, ref_count = max(fast.values())
    problems.append(
      f"the optimizer's step count is {count:.0f} after {steps} updates (whole "
      f"batch: {ref_count:.0f}): it ran on micro-steps, so schedules and Adam's bias "
      "correction run ahead"
    )
  if problems:
    return Verdict("FOUND", "; ".join(problems), FIXES["F3"])
  lrs = any(any(v) for v in run.learning_rates.values())
  if not lrs and not counted:
    if reference.learning_rates or reference.counts:
      return Verdict("n/a", "your state holds none of the optimizer's counters")
    return Verdict(
      "n/a",
      "no learning rate or step count in the optimizer state: inject the learning "
      "rate (optax.inject_hyperparams) to have it checked",
    )
  what = [
    "learning rate n at update n" if lrs else "",
    "one optimizer step per update" if counted else "",
  ]
  return Verdict("ok", ", ".join(w for w in what if w))


def _verdicts(
  r: AuditReport,
  fit: GradientFit,
  probe_changed: list[bool],
  comparison: ParamsComparison,
  reference: Reference,
  run: SetupRun,
  tolerance: float,
  steps: int,
) -> dict[str, Verdict]:
  """One verdict per failure id, from the measurements."""
  v: dict[str, Verdict] = {}
  v["F7"], v["F4"], aligned = _window_verdicts(r)
  if reference.nonfinite_at is not None:
    v["F7"] = v["F4"] = Verdict("n/a", "the whole-batch run diverges")
  elif run.nonfinite_at is not None:  # NaN params compare equal to NaN params.
    v["F7"] = v["F4"] = Verdict("n/a", "your params became non-finite")
  v["F1"], v["F6"], gradient_problem = _gradient_verdicts(r, fit, probe_changed)
  v["F3"] = _schedule_verdict(reference, run, steps)
  explained = any(x.status == "FOUND" for x in v.values())

  problems, fix = [], ""
  if reference.nonfinite_at is not None:
    low = ", ".join(f"{n} = {x:.4g}" for n, x in reference.low_precision.items())
    problems.append(
      f"the whole-batch run diverges too: its params are not finite after update "
      f"{reference.nonfinite_at}, without any accumulation"
      + (f" (its hyperparameters are below float32: {low})" if low else "")
    )
    fix = (
      "make the optimizer work on the whole batch first, then audit again (in "
      "bfloat16, b2=0.999 rounds to 1.0 and Adam divides by 0: keep "
      "hyperparameters and moments in float32)"
    )
  elif run.nonfinite_at is not None:
    problems.append(
      f"params became non-finite after micro-step {run.nonfinite_at} (the whole "
      "batch's stay finite)"
    )
    fix = "compare your loop with optax_accum.make_train_step, micro-step by micro-step"
  if not any(r.expected_changes):
    problems.append(
      "the whole-batch run never changed the params, so nothing could be "
      "compared (a learning rate of 0?)"
    )
    fix = fix or "audit with an optimizer that changes the params"
  if not explained and gradient_problem:
    problems.append(gradient_problem)
    fix = fix or (
      "the setup applies another gradient than the whole batch's: compare its "
      "window sum and divisor with optax_accum.MultiSteps"
    )
  off = comparison.first_off
  if not explained and not problems and off is not None and comparison.worst:
    leaf, dist, noise = comparison.worst
    problems.append(
      f"params end {r.params_diff:.1e} from the whole batch's; leaf {leaf} is "
      f"{dist:.1e} off after update {off} (rounding alone: {noise:.1e})"
    )
    if off == 1 and fit.kind == "whole" and aligned:
      fix = (
        "the first window's gradient matches but the first update does not: the "
        "optimizer gets other params, extra arguments or state than on the "
        "whole batch"
      )
    else:
      fix = (
        f"updates 1-{off - 1} match: something carried from window to window "
        "differs (the optimizer state, a count, an accumulator not emptied)"
        if off > 1
        else "compare your loop with optax_accum.make_train_step, micro-step by "
        "micro-step"
      )
  v["other"] = (
    Verdict("FOUND", "; ".join(problems), fix)
    if problems
    else Verdict("ok", "nothing else differs")
  )
  return {failure: v[failure] for failure in FAILURES}

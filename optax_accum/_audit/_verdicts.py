"""The verdicts of ``audit``: which failure, if any, explains each measurement.

F3 is decided first: a schedule stepped too fast explains params that stop
moving. F4 and F7 (``_windows``) are decided from where the loop applies
its updates, which no learning rate changes.
"""

from __future__ import annotations

import dataclasses

from optax_accum._audit._compare import GradientFit, ParamsComparison
from optax_accum._audit._report import (
  FAILURES,
  FIXES,
  AuditReport,
  Verdict,
  lr_labels,
  place_in_state,
)
from optax_accum._audit._runs import LoopRun, Path, Reference
from optax_accum._audit._terms import TermsEvidence, terms_verdict
from optax_accum._audit._weighting import NOUNS, Weighting, counts_text, short_vector
from optax_accum._audit._windows import Windows, window_verdicts
from optax_accum._core import _format

#: Relative difference between learning rates that counts.
LR_TOLERANCE = 1e-5
_COMPARE_LOOP = (
  "compare your loop with optax_accum.make_train_step, micro-step by micro-step"
)
_NO_PROBE = (
  "the accumulator sits inside your optimizer, so the audit cannot run it around "
  "its gradient probe; the params are compared instead"
)


@dataclasses.dataclass(frozen=True)
class Evidence:
  """What the verdicts weigh besides the report's own numbers.

  Attributes:
    fit: What the first window's applied gradient is; ``None`` without a probe.
    probe: The probe's run; ``None`` where the setup cannot be probed.
    windows: Where the loop applies updates, and where it should.
    comparison: The setup's params against the whole batch's.
    reference: The whole-batch run.
    run: The setup's run.
    steps: Updates before the restart.
    chained: Whether the accumulator sits inside the optimizer.
    terms: With loss terms, what the ``terms`` verdict weighs.
    coupled: Where the whole batch's gradient is no combination of its
      micro-batches' (with loss terms: not their terms' weighted sum), beyond
      the tolerance, how far off: the loss couples them. ``None`` for a sum
      over examples.
    weighting: Without loss terms, how the whole batch weighs the
      micro-batches' gradients.
  """

  fit: GradientFit | None
  probe: LoopRun | None
  windows: Windows
  comparison: ParamsComparison
  reference: Reference
  run: LoopRun
  steps: int
  chained: bool
  terms: TermsEvidence | None = None
  coupled: float | None = None
  weighting: Weighting | None = None


def _coupled_verdict(e: Evidence) -> Verdict | None:
  """Whether a loss that couples the micro-batches is taken per micro-batch:
  found unless the setup applies the whole batch's gradient anyway."""
  if e.coupled is None:
    return None
  if e.fit is not None and e.fit.kind == "whole":
    return Verdict("ok", "the setup applies the whole window's gradient")
  if e.terms is not None:
    detail = (
      f"the whole batch's gradient is {e.coupled:.1e} from its micro-batches' "
      "token-weighted sum: the loss is not a sum over examples, and the window "
      "applies the sum"
    )
  else:
    detail = (
      f"the whole batch's gradient is {e.coupled:.1e} from the nearest "
      "combination of its micro-batches' gradients: the loss is not a sum over "
      "examples (no weight reproduces it), and the window applies a combination"
    )
  return Verdict("FOUND", detail, FIXES["F10"])


def _told(w: Weighting) -> str:
  """How the setup is told to weigh the micro-batches, in words."""
  if w.declared == "sum":
    return "grad_reduction='window_mean' sums them as they are (1 each)"
  name, n = w.weight_name, counts_text(w.counts.weight)
  return f"loss_fn's weight is {n}" + ("" if name == "weight" else f" ({name})")


def _weight_verdict(e: Evidence) -> Verdict | None:
  """Whether ``loss_fn``'s weight (or ``grad_reduction``) weighs the
  micro-batches as the whole batch does; ``None`` with loss terms (the terms
  row says) or a loss that couples them (F10 says)."""
  w = e.weighting
  if w is None or w.kind == "coupled":
    return None
  if w.as_declared:
    told = (
      "as grad_reduction='window_mean' does"
      if w.declared == "sum"
      else "as loss_fn's weight says"
    )
    return Verdict("ok", f"the whole batch {w.describe()}, {told}")
  told_c = w.counts.coefficients(w.declared)
  shares = (
    ""
    if told_c is None
    else f": {short_vector(w.coefficients)}, not {short_vector(told_c)}"
  )
  detail = f"the whole batch {w.describe()}, but {_told(w)}{shares}"
  if e.fit is not None and e.fit.kind == "whole":
    return Verdict(
      "ok",
      f"your setup applies the whole batch's gradient, which {w.describe()}; "
      f"{_told(w)}, which would not give it in optax_accum.MultiSteps' "
      "default step (grad_reduction='mean')",
    )
  return Verdict("FOUND", detail, w.fix())


def _f1_fix(r: AuditReport, w: Weighting | None) -> str:
  """F1's fix: pass the count the whole batch weighs by."""
  if r.term_weights:
    return FIXES["terms"]
  if w is not None and w.kind not in ("weight", "rows", "positions"):
    return w.fix()
  name = r.weight_name if w is None or w.kind == "weight" else w.kind
  count, var = NOUNS[name]
  return FIXES["F1"].format(count=count, var=var)


def _gradient_verdicts(
  r: AuditReport,
  fit: GradientFit | None,
  probe: LoopRun | None,
  weighting: Weighting | None = None,
) -> tuple[Verdict, Verdict, str | None]:
  """F1 and F6 from the probe's first window; and an unexplained gradient problem."""
  k = r.k
  if fit is None or probe is None:
    return Verdict("n/a", _NO_PROBE), Verdict("n/a", _NO_PROBE), None
  probe_changed = probe.changed[:k]
  if probe_changed != [False] * (k - 1) + [True]:
    where = _format.marks(probe_changed)
    na = Verdict("n/a", f"the first window changed params at {where}, not at its end")
    return na, na, None
  if fit.kind == "whole":
    return (
      Verdict("ok", f"gradient matches the whole batch ({fit.error:.1e})"),
      Verdict("ok", "every micro-batch is in the gradient"),
      None,
    )
  off = f"gradient off by {fit.error:.1e}"
  if fit.kind == "terms":
    na = Verdict("n/a", "a loss term is weighted by another count (see terms)")
    return na, na, None
  if fit.kind == "declared":
    na = Verdict("n/a", f"{off}: the micro-batches weighed as told (see weight)")
    return na, na, None
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
        f"{off}: it is {fit.what} ({r.weight_name} {lo:.3g}-{hi:.3g})",
        _f1_fix(r, weighting),
      ),
      Verdict("ok", "every micro-batch is in the gradient"),
      None,
    )
  na = Verdict("n/a", "the gradient differs in another way")
  return na, na, f"the window {off}: {fit.what}"


def _learning_rate_problems(
  reference: Reference, run: LoopRun, compared: int
) -> list[str]:
  """The first update at which each injected learning rate differs."""
  labels = lr_labels(list(reference.learning_rates))
  problems = []
  for path, ref_values in reference.learning_rates.items():
    pairs = zip(run.learning_rates[path][:compared], ref_values, strict=False)
    for n, (mine, ref) in enumerate(pairs):
      bad = [v for v in mine if abs(v - ref) > LR_TOLERANCE * max(abs(ref), 1e-12)]
      if bad:
        where = f" of {labels[path]}" if labels[path] else ""
        problems.append(
          f"learning rate{where} is {bad[0]:.3g} at update {n + 1} (whole batch: "
          f"{ref:.3g})"
        )
        break
  return problems


def _count_problem(
  counted: dict[Path, tuple[float, float]], steps: int, chained: bool
) -> tuple[str, str] | None:
  """The step count furthest ahead of the whole batch's, and the fix."""
  fast = {path: c for path, c in counted.items() if c[0] > c[1]}
  if not fast:
    return None
  path = max(fast, key=lambda p: fast[p][0])
  count, ref_count = fast[path]
  after = f"after {steps} updates (whole batch: {ref_count:.0f})"
  if chained and "inner_opt_state" not in path:
    return (
      f"the step count of {place_in_state(path[:-1])}, chained after the "
      f"accumulator, is {count:.0f} {after}: it runs on every micro-step, so its "
      "schedule runs ahead",
      FIXES["F3 chained"],
    )
  return (
    f"the optimizer's step count is {count:.0f} {after}: it ran on micro-steps, so "
    "schedules and Adam's bias correction run ahead",
    FIXES["F3"],
  )


def _schedule_verdict(e: Evidence) -> Verdict:
  """F3 from every injected learning rate and every step count."""
  reference, run, steps = e.reference, e.run, e.steps
  problems = _learning_rate_problems(reference, run, e.windows.compared)
  counted = {
    path: (max(run.counts[path]), ref[steps - 1])
    for path, ref in reference.counts.items()
    if run.counts.get(path)
  }
  count = _count_problem(counted, steps, e.chained)
  fix = FIXES["F3"]
  if count:
    problems.append(count[0])
    fix = count[1]
  if problems:
    note = _zero_update_note(e.windows)
    return Verdict("FOUND", "; ".join(problems + ([note] if note else [])), fix)
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


def _zero_update_note(w: Windows) -> str:
  """Which of the updates the loop applies move nothing: what F3 explains."""
  zero, applied = w.zero_updates() if w.measured else ([], 0)
  if not zero:
    return ""
  if len(zero) == applied:
    return (
      f"stepped that far, your optimizer returns zero updates: none of the "
      f"{applied} updates your loop applies moves the params"
    )
  where = f"micro-step {zero[0] + 1}" if zero[0] < len(w.applied) else "the restart"
  return (
    f"stepped that far, your optimizer returns zero updates from {where}: "
    f"{len(zero)} of the {applied} updates your loop applies move nothing"
  )


def verdicts(r: AuditReport, evidence: Evidence) -> dict[str, Verdict]:
  """One verdict per failure id, from the measurements."""
  reference, run = evidence.reference, evidence.run
  v: dict[str, Verdict] = {"F3": _schedule_verdict(evidence)}
  v["F7"], v["F4"] = window_verdicts(evidence.windows, v["F3"].status == "FOUND")
  if reference.nonfinite_at is not None:
    v["F7"] = v["F4"] = Verdict("n/a", "the whole-batch run diverges")
  elif run.nonfinite_at is not None:  # NaN params compare equal to NaN params.
    v["F7"] = v["F4"] = Verdict("n/a", "your params became non-finite")
  weighting = evidence.weighting
  v["F1"], v["F6"], gradient_problem = _gradient_verdicts(
    r, evidence.fit, evidence.probe, weighting
  )
  if evidence.terms is not None:
    v["terms"] = terms_verdict(evidence.terms, evidence.fit)
  weight = _weight_verdict(evidence)
  if weight is not None:
    v["weight"] = weight
  coupled = _coupled_verdict(evidence)
  if coupled is not None:
    v["F10"] = coupled
    if coupled.status == "FOUND":  # The rest follows from it.
      v["F1"] = v["F6"] = Verdict("n/a", "the loss couples the micro-batches")
  explained = any(x.status == "FOUND" for x in v.values())
  problems, fix = _nonfinite_problems(reference, run)
  if not any(reference.changed):
    problems.append(
      "the whole-batch run never changed the params, so nothing could be "
      "compared (a learning rate of 0?)"
    )
    fix = fix or "audit with an optimizer that changes the params"
  if not explained and gradient_problem:
    problems.append(gradient_problem)
    fix = fix or _other_gradient_fix(weighting)
  if not explained and not problems:
    problems, fix = _trajectory_problems(r, evidence, v["F4"].status != "FOUND")
  v["other"] = (
    Verdict("FOUND", "; ".join(problems), fix)
    if problems
    else Verdict("ok", "nothing else differs")
  )
  return {failure: v[failure] for failure in FAILURES if failure in v}


def _other_gradient_fix(w: Weighting | None) -> str:
  """What makes a setup apply the whole batch's gradient: the weight and the
  ``grad_reduction`` its weighting needs."""
  if w is None or w.kind == "coupled":
    return (
      "the setup applies another gradient than the whole batch's: compare its "
      "window sum and divisor with optax_accum.MultiSteps, whose weight is the "
      "count the loss divides by (grad_reduction='mean'), or 1 for a loss "
      "divided by a constant (grad_reduction='window_mean')"
    )
  return (
    "the setup applies another gradient than the whole batch's, which "
    f"{w.describe()}: {w.fix()}"
  )


def _nonfinite_problems(reference: Reference, run: LoopRun) -> tuple[list[str], str]:
  """Params that stopped being finite, on either side; and the fix."""
  if reference.nonfinite_at is not None:
    low = ", ".join(f"{n} = {x:.4g}" for n, x in reference.low_precision.items())
    problem = (
      f"the whole-batch run diverges too: its params are not finite after update "
      f"{reference.nonfinite_at}, without any accumulation"
      + (f" (its hyperparameters are below float32: {low})" if low else "")
    )
    return [problem], (
      "make the optimizer work on the whole batch first, then audit again (in "
      "bfloat16, b2=0.999 rounds to 1.0 and Adam divides by 0: keep "
      "hyperparameters and moments in float32)"
    )
  if run.nonfinite_at is not None:
    problem = (
      f"params became non-finite after micro-step {run.nonfinite_at} (the whole "
      "batch's stay finite)"
    )
    return [problem], _COMPARE_LOOP
  return [], ""


def _trajectory_problems(
  r: AuditReport, evidence: Evidence, aligned: bool
) -> tuple[list[str], str]:
  """A leaf that ends further from the whole batch's than rounding explains."""
  comparison = evidence.comparison
  off = comparison.first_off
  if off is None or not comparison.worst:
    return [], ""
  leaf, dist, noise = comparison.worst
  problem = (
    f"params end {r.params_diff:.1e} from the whole batch's; leaf {leaf} is "
    f"{dist:.1e} off after update {off} (rounding alone: {noise:.1e})"
  )
  fit = evidence.fit
  if off == 1 and fit is not None and fit.kind == "whole" and aligned:
    return [problem], (
      "the first window's gradient matches but the first update does not: the "
      "optimizer gets other params, extra arguments or state than on the "
      "whole batch"
    )
  if off > 1:
    restart = (
      f" (update {evidence.steps + 1} is the first after the restart)"
      if off > evidence.steps
      else ""
    )
    matched = "update 1 matches" if off == 2 else f"updates 1-{off - 1} match"
    return [problem], (
      f"{matched}{restart}: something that changes from window to window "
      "differs (the optimizer state, a count, an accumulator not emptied, or a "
      "micro-batch of a later window dropped or weighed otherwise: F6 checks "
      "the first window only)"
    )
  return [problem], _COMPARE_LOOP

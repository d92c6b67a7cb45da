"""The verdicts of ``audit``: which failure, if any, explains each measurement."""

from __future__ import annotations

import dataclasses

from optax_accum import _report
from optax_accum._audit_compare import GradientFit, ParamsComparison
from optax_accum._audit_report import FAILURES, AuditReport, Verdict, lr_labels
from optax_accum._audit_runs import Reference, SetupRun

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
_COMPARE_LOOP = (
  "compare your loop with optax_accum.make_train_step, micro-step by micro-step"
)


@dataclasses.dataclass(frozen=True)
class Evidence:
  """What the verdicts weigh besides the report's own numbers.

  Attributes:
    fit: What the first window's applied gradient is.
    probe_changed: For each micro-step of that window, whether params changed.
    comparison: The setup's params against the whole batch's.
    reference: The whole-batch run.
    run: The setup's run.
    steps: Updates run.
  """

  fit: GradientFit
  probe_changed: list[bool]
  comparison: ParamsComparison
  reference: Reference
  run: SetupRun
  steps: int


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
    where = _report.marks(probe_changed)
    na = Verdict("n/a", f"the first window changed params at {where}, not at its end")
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
  labels = lr_labels(list(reference.learning_rates))
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


def verdicts(r: AuditReport, evidence: Evidence) -> dict[str, Verdict]:
  """One verdict per failure id, from the measurements."""
  reference, run = evidence.reference, evidence.run
  v: dict[str, Verdict] = {}
  v["F7"], v["F4"], aligned = _window_verdicts(r)
  if reference.nonfinite_at is not None:
    v["F7"] = v["F4"] = Verdict("n/a", "the whole-batch run diverges")
  elif run.nonfinite_at is not None:  # NaN params compare equal to NaN params.
    v["F7"] = v["F4"] = Verdict("n/a", "your params became non-finite")
  v["F1"], v["F6"], gradient_problem = _gradient_verdicts(
    r, evidence.fit, evidence.probe_changed
  )
  v["F3"] = _schedule_verdict(reference, run, evidence.steps)
  explained = any(x.status == "FOUND" for x in v.values())
  problems, fix = _nonfinite_problems(reference, run)
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
  if not explained and not problems:
    problems, fix = _trajectory_problems(r, evidence, aligned)
  v["other"] = (
    Verdict("FOUND", "; ".join(problems), fix)
    if problems
    else Verdict("ok", "nothing else differs")
  )
  return {failure: v[failure] for failure in FAILURES}


def _nonfinite_problems(reference: Reference, run: SetupRun) -> tuple[list[str], str]:
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
  if off == 1 and evidence.fit.kind == "whole" and aligned:
    return [problem], (
      "the first window's gradient matches but the first update does not: the "
      "optimizer gets other params, extra arguments or state than on the "
      "whole batch"
    )
  if off > 1:
    return [problem], (
      f"updates 1-{off - 1} match: something carried from window to window "
      "differs (the optimizer state, a count, an accumulator not emptied)"
    )
  return [problem], _COMPARE_LOOP

"""``audit``: check an accumulation setup against training on the whole batch."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum._audit._compare import (
  GradientFit,
  compare_params,
  fit_gradient,
  leaf_names,
  rounding_level_leaves,
)
from optax_accum._audit._loops import LossView
from optax_accum._audit._report import AuditReport, Verdict, lr_labels
from optax_accum._audit._runs import (
  BatchGradient,
  GradFn,
  LoopRun,
  Reference,
  copy_arrays,
  f32,
  gradient_fn,
  recombined,
  resummed_gradient,
  run_setup,
  summed,
  whole_batch_run,
  whole_gradient,
)
from optax_accum._audit._setups import Accumulation, Setup, check_loss_fn, resolve_setup
from optax_accum._audit._terms import (
  TermFit,
  TermGradFn,
  TermsBatch,
  TermsEvidence,
  batch_gradient,
  declaration_problems,
  explain,
  loss_terms,
  measure,
  term_gradient_fn,
)
from optax_accum._audit._verdicts import Evidence, verdicts
from optax_accum._audit._weighting import (
  Counts,
  Weighting,
  combined,
  find,
  report_fields,
  shares,
)
from optax_accum._audit._windows import Windows, needs_probe, per_micro_step, windows
from optax_accum._core import _backend, _checks
from optax_accum._core._multi_steps import NO_WEIGHT
from optax_accum._progress import split_micro_batches

__all__ = ["Accumulation", "AuditReport", "Verdict", "audit"]


def _as_audited(fn: Callable[..., AuditReport]) -> Any:
  """``fn`` with :data:`NO_WEIGHT` warnings silenced (a loop without weights is
  what the audit runs to find, and says so in its report), and the programs
  it builds compiled quickly where the backend says how (their run time on
  a few batches is nothing beside their compile time)."""

  @functools.wraps(fn)
  def audited(*args: Any, **kwargs: Any) -> AuditReport:
    quick = _backend.for_platform(jax.default_backend()).quick_compile
    with warnings.catch_warnings(), _backend.compiled_with(quick):
      warnings.filterwarnings("ignore", message=NO_WEIGHT)
      return fn(*args, **kwargs)

  return audited


@_as_audited
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
  whole batch) or holds an :class:`optax_accum.MultiSteps`
  (``optax.chain(MultiSteps(...).gradient_transformation(), ...)``, whose
  window the whole batch ends on every update); otherwise
  :class:`optax_accum.MultiSteps` in :func:`optax_accum.make_train_step`.

  The setup runs ``steps`` updates, then one micro-step more, then is built
  again (as a restarted process would) and fed ``2 k`` more micro-batches from
  the params and state it had: updates ``steps + 1`` and ``steps + 2``,
  compared with the whole batch too where their windows line up.

  The setup also runs around the probe, ``optimizer`` with its updates
  replaced by the gradient (its state advances as the optimizer's would, so a
  loop may read ``.hyperparams`` or a count from it), on float32 copies of the
  params: for the first window, which shows the gradient the setup applies;
  and for the whole run where the setup's params do not change at exactly the
  window ends, which shows where it applies updates whatever the learning
  rate (a schedule that reaches 0 stops the params, not the updates).

  The weight the loss needs is found from the whole batch: the weighting of
  the first batch's micro-batch gradients that gives its gradient, among
  ``loss_fn``'s weight, the rows, the positions (each a mean over that count)
  and a plain sum (a loss divided by a constant:
  ``grad_reduction="window_mean"``); the ``weight`` verdict says where it is
  not the one the setup is told. A second whole-batch run sums the
  micro-batch gradients so weighted instead of taking the batch's own: the two
  differ by rounding only, which sets how close each leaf of the setup's
  params must end.

  Every run gets its own copy of ``params``, so a setup that donates its
  buffers is fine. Your ``step`` must apply the updates its optimizer returns;
  it may read the optimizer state.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, weight)``, the token-mean loss
      and the number of tokens, or ``(loss, (weight, aux))`` with ``has_aux``;
      with an ``optax_accum.MultiSteps(grad_reduction="sum")`` as
      ``optimizer``, the loss summed over tokens, as the train step takes it
      (the whole batch then takes its token mean); with
      ``grad_reduction="window_mean"``, each micro-batch's share (the summed
      loss divided by a constant), which the whole batch takes as it is. Or
      loss terms, ``{name: (value, weight)}`` (and the aux with ``has_aux``):
      each a mean over its own items and their count. The whole batch's
      objective is then each term's weighted mean over the micro-batches,
      summed, and a ``terms`` verdict names a term your setup or your weights
      normalise by the wrong count (``docs/audit.md``).
    optimizer: The optimizer the whole batch would use, or your accumulator
      around it (``optax.MultiSteps(opt, k)``). Learning rates injected with
      ``optax.inject_hyperparams`` are compared at every update, in every
      branch; step counts (``count``) are compared whether injected or not.
    params: Initial params (not modified).
    batch: One batch, reused for every update, or a ``list`` of ``steps``
      batches (the updates after the restart reuse the first two); leaves
      have a leading batch axis.
    k: Micro-batches per update (an accumulator's own, where it has one).
    steps: Updates before the restart.
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
      weight)`` or loss terms (or other terms than an
      :class:`optax_accum.MultiSteps` passed declares), an accumulator passed
      with ``accumulation``, an
      ``optax.MultiSteps`` inside another transformation, or a setup that
      returns params of another structure.
  """
  k = _checks.whole_number(k, name="k")
  steps = _checks.whole_number(steps, name="steps")
  batches, micro = _micro_batches(batch, k, steps, split)
  _checks.callable_arg(loss_fn, name="loss_fn")
  term_names = loss_terms(loss_fn, bool(has_aux), params, micro[0][0])
  setup = resolve_setup(
    LossView(loss_fn, bool(has_aux), terms=term_names),
    optimizer,
    params,
    k,
    accumulation,
  )
  check_loss_fn(setup.loss, params, micro[0][0])
  gradients = _gradients(setup, tolerance)
  first = _first_batch(gradients, params, batches, micro, tolerance, setup.declared)
  gradients = _resummed_as(first.weighting, gradients)
  # Updates steps + 1 and steps + 2 (after the restart) reuse the first batches.
  reference, resummed = _whole_batch_runs(setup, gradients, params, batches, micro)
  run = _setup_run(setup, k, params, micro, reference)
  probe, w = _probe_runs(setup, k, steps, first.params32, micro, reference, run)
  fit, term_fit = (None, None) if probe is None else _fit(probe, first, tolerance)
  trajectory_tol = _trajectory_tolerance(params, tolerance)
  coupled = _coupling(first, tolerance)
  skip = [] if coupled else rounding_level_leaves(first.whole_grad, first.resummed_grad)
  n = w.compared
  comparison = compare_params(
    reference.params[:n], resummed.params[:n], run.params[:n], skip, trajectory_tol
  )
  chained = setup.probe is None
  terms = _terms_evidence(first, term_fit, tolerance)
  evidence = Evidence(
    fit,
    probe,
    w,
    comparison,
    reference,
    run,
    steps,
    chained,
    terms,
    coupled,
    first.weighting,
  )
  skipped = [leaf_names(params)[i] for i in skip]
  report = _report(setup.name, first, evidence, skipped, trajectory_tol)
  report.verdicts = verdicts(report, evidence)
  return report


def _resummed_as(weighting: Weighting | None, gradients: _Gradients) -> _Gradients:
  """``gradients`` whose resummed run weighs the micro-batches as the whole
  batch does (``weighting``): the rounding allowance of the right weighting."""
  if weighting is None:
    return gradients
  return dataclasses.replace(
    gradients, resummed=weighting.batch_gradient(gradients.one)
  )


def _trajectory_tolerance(params: Any, tolerance: float) -> float:
  """``tolerance``, or 32 ulps of the params' narrowest dtype where larger."""
  lowest = min(jnp.finfo(jnp.result_type(x)).eps for x in jax.tree.leaves(params))
  return max(tolerance, 32 * float(lowest))


def _terms_evidence(
  first: _FirstBatch, fit: TermFit | None, tolerance: float
) -> TermsEvidence | None:
  """With loss terms, the declarations checked against the whole batch."""
  if first.terms is None:
    return None
  declared = declaration_problems(first.terms, first.params32, tolerance)
  return TermsEvidence(first.terms, declared, fit)


@dataclasses.dataclass(frozen=True)
class _Gradients:
  """How the audit takes gradients: a micro-batch's (``one``, or ``of_terms``
  by loss term), and the whole batch's (``whole``) and its exact re-summation
  over the micro-batches (``resummed``)."""

  one: GradFn
  of_terms: TermGradFn | None
  names: tuple[str, ...]
  whole: BatchGradient
  resummed: BatchGradient


def _gradients(setup: Setup, tolerance: float) -> _Gradients:
  grad_fn = gradient_fn(setup.loss)
  names = setup.loss.terms
  if not names:
    return _Gradients(
      grad_fn, None, (), whole_gradient(grad_fn), resummed_gradient(grad_fn)
    )
  term_fn = term_gradient_fn(setup.loss)
  by_term = setup.ends_windows
  return _Gradients(
    grad_fn,
    term_fn,
    names,
    batch_gradient(term_fn, names, tolerance, resum=False, by_term=by_term),
    batch_gradient(term_fn, names, tolerance, resum=True, by_term=by_term),
  )


def _coupling(first: _FirstBatch, tolerance: float) -> float | None:
  """Where the loss couples the micro-batches, how far the whole batch's
  gradient is from them: from the nearest combination of their gradients
  (with loss terms, from their terms' weighted sum), where beyond
  ``tolerance``."""
  if first.weighting is not None:
    coupled = first.weighting.kind == "coupled"
    return first.weighting.residual if coupled else None
  gap = optax.tree.norm(
    jax.tree.map(jnp.subtract, first.whole_grad, first.resummed_grad)
  )
  gap = float(gap / optax.tree.norm(first.whole_grad))
  return gap if gap > tolerance else None


def _every_kth_row(batch: Any, k: int) -> list[Any]:
  """The default ``split``: :func:`split_micro_batches`, as a list."""
  stacked = split_micro_batches(batch, k)
  return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(k)]


def _micro_batches(
  batch: Any,
  k: int,
  steps: int,
  split: Callable[[Any, int], Sequence[Any]] | None,
) -> tuple[list[Any], list[list[Any]]]:
  """The batch of each update, and its ``k`` micro-batches."""
  batches = list(batch) if isinstance(batch, list) else [batch] * steps
  if len(batches) != steps:
    raise ValueError(f"`batch` holds {len(batches)} batches for steps={steps}.")
  if split is None:
    split = _every_kth_row
  micro = [list(split(b, k)) for b in batches]
  if len(micro[0]) != k:
    raise ValueError(f"`split` returned {len(micro[0])} micro-batches for k={k}.")
  return batches, micro


@dataclasses.dataclass(frozen=True)
class _FirstBatch:
  """The first batch's gradients, on float32 params.

  Attributes:
    params32: The params in float32.
    whole_grad: The whole batch's gradient.
    micro_grads: Each micro-batch's (mean-loss) gradient.
    tokens: Each micro-batch's weight.
    resummed_grad: The micro-batch gradients weighted as the whole batch
      weighs them (``weighting``; with loss terms, each term's weighted mean):
      the whole batch's gradient summed in another order.
    uniform_grad: Their plain mean, what F1 applies.
    terms: With loss terms, each term's gradients and weights (then each
      micro-batch's gradient is that of the terms' sum, ``tokens`` the weights
      of the first term with weight, and the whole batch's the sum of each
      term's).
    weighting: Without loss terms, how the whole batch weighs the
      micro-batches' gradients.
  """

  params32: Any
  whole_grad: Any
  micro_grads: list[Any]
  tokens: list[float]
  resummed_grad: Any
  uniform_grad: Any
  terms: TermsBatch | None = None
  weighting: Weighting | None = None


def _first_batch(
  gradients: _Gradients,
  params: Any,
  batches: Sequence[Any],
  windows: Sequence[Sequence[Any]],
  tolerance: float,
  declared: str = "weight",
) -> _FirstBatch:
  batch, window = batches[0], windows[0]  # The measurements: the first batch.
  params32 = f32(params)
  terms = weighting = None
  if gradients.of_terms is None:
    whole_grad, _ = gradients.one(params32, batch)
    pairs = [gradients.one(params32, m) for m in window]
    micro_grads = [g for g, _ in pairs]
    tokens = [float(w) for _, w in pairs]
    counts = Counts.of(window, tokens)
    weighting = find(whole_grad, micro_grads, counts, declared, tolerance)
    if weighting.kind == "coupled":  # No combination: the loss's own weight.
      resummed_grad = recombined(micro_grads, tokens, params32)
    else:
      resummed_grad = combined(micro_grads, weighting.coefficients, params32)
  else:  # Each micro-batch's gradient is that of the terms' sum.
    terms = measure(gradients.of_terms, gradients.names, params32, batch, window)
    whole_grad = summed(terms.reference(params32, tolerance))
    resummed_grad = summed(
      [terms.recombined(t, params32) for t in range(len(terms.names))]
    )
    micro_grads = [summed(list(g)) for g in zip(*terms.grads, strict=True)]
    weighted = [w for w in terms.weights if w.sum() > 0] or [terms.weights[0]]
    tokens = [float(w) for w in weighted[0]]
  if not sum(tokens) > 0:
    raise ValueError(f"The first batch holds no tokens: weights {tokens}.")
  k = len(micro_grads)
  uniform_grad = jax.tree.map(lambda *g: sum(g) / k, *micro_grads)
  return _FirstBatch(
    params32,
    whole_grad,
    micro_grads,
    tokens,
    resummed_grad,
    uniform_grad,
    terms,
    weighting,
  )


def _whole_batch_runs(
  setup: Setup,
  gradients: _Gradients,
  params: Any,
  batches: list[Any],
  micro: list[list[Any]],
) -> tuple[Reference, Reference]:
  """The whole batch over ``steps + 2`` updates, and its exact re-summation."""
  ahead = len(batches) + 2
  batches = [batches[i % len(batches)] for i in range(ahead)]
  micro = [micro[i % len(micro)] for i in range(ahead)]
  optimizer, ends = setup.optimizer, setup.ends_windows
  reference = whole_batch_run(gradients.whole, optimizer, params, batches, micro, ends)
  resummed = whole_batch_run(
    gradients.resummed, optimizer, params, batches, micro, ends
  )
  return reference, resummed


def _setup_run(
  setup: Setup, k: int, params: Any, micro: list[list[Any]], reference: Reference
) -> LoopRun:
  """The setup around the real optimizer, on a copy of ``params``."""
  run = run_setup(
    setup.accumulation,
    setup.optimizer,
    k,
    copy_arrays(params),
    micro,
    list(reference.learning_rates),
    list(reference.counts),
  )
  _checks.check_tree_matches(
    run.params[0],
    reference.params[0],
    name="params your step returns",
    ref_name="the params given",
  )
  return run


def _probe_runs(
  setup: Setup,
  k: int,
  steps: int,
  params32: Any,
  micro: list[list[Any]],
  reference: Reference,
  run: LoopRun,
) -> tuple[LoopRun | None, Windows]:
  """The probe's first window (``None`` without a probe), and where the setup
  applies updates: from the probe's whole run where its params leave it open."""
  if setup.probe is None:
    return None, windows(k, steps, reference, run, None)
  acc, probe = setup.accumulation, setup.probe
  first = run_setup(acc, probe, k, params32, micro[:1], restart=False)
  whole = None
  if needs_probe(k, steps, reference, run):  # A learning rate of 0, or a bug.
    whole = run_setup(acc, probe, k, params32, micro)
  return first, windows(k, steps, reference, run, whole)


def _fit(
  probe: LoopRun, first: _FirstBatch, tolerance: float
) -> tuple[GradientFit, TermFit | None]:
  """What the gradient the probe applied in the first window is; with loss
  terms, which terms it weighs otherwise."""
  applied = jax.tree.map(jnp.subtract, first.params32, f32(probe.params[0]))
  right, declared = shares(first.weighting)
  fit = fit_gradient(
    applied,
    first.whole_grad,
    first.micro_grads,
    first.tokens,
    tolerance,
    right,
    declared,
  )
  if first.terms is None:
    return fit, None
  return explain(fit, applied, first.terms, tolerance)


def _report(
  name: str,
  first: _FirstBatch,
  evidence: Evidence,
  rounding_leaves: list[str],
  tolerance: float,
) -> AuditReport:
  """The report of the measurements, verdicts not yet drawn."""
  reference, run, fit, w = (
    evidence.reference,
    evidence.run,
    evidence.fit,
    evidence.windows,
  )
  labels = lr_labels(list(reference.learning_rates))
  expected = per_micro_step(reference.changed, w.k, w.steps)
  lr = {
    labels[path]: [v[0] for v in values[: w.compared] if v]
    for path, values in run.learning_rates.items()
  }
  return AuditReport(
    setup=name,
    k=w.k,
    tokens=first.tokens,
    mean_of_means_bias=_rel(first.uniform_grad, first.whole_grad),
    grad_error=float("nan") if fit is None else fit.error,
    grad_fit="not measured: " + _NOT_MEASURED if fit is None else fit.describe,
    grad_scale=float("nan") if fit is None else fit.scale,
    micro_batch_weights=None if fit is None else fit.coefficients,
    params_diff=evidence.comparison.diff,
    rounding_diff=evidence.comparison.rounding,
    rounding_leaves=rounding_leaves,
    finite=run.nonfinite_at is None,
    reference_finite=reference.nonfinite_at is None,
    lr=lr,
    lr_reference={
      labels[p]: v[: w.compared] for p, v in reference.learning_rates.items()
    },
    changed=run.changed,
    expected_changes=expected[0],
    resumed=run.resumed,
    expected_resumed=expected[1],
    applied=w.applied,
    expected_applied=w.expected,
    applied_resumed=w.applied_resumed,
    expected_applied_resumed=w.expected_resumed,
    updates_compared=w.compared,
    tolerance=tolerance,
    **_term_fields(evidence.terms),
    **report_fields(first.weighting),
  )


def _term_fields(terms: TermsEvidence | None) -> dict[str, Any]:
  """The report's ``term_weights`` and ``term_coefficients``."""
  if terms is None:
    return {}
  weights = terms.batch.weights
  return {
    "term_weights": {
      name: [float(x) for x in weights[t]] for t, name in enumerate(terms.batch.names)
    },
    "term_coefficients": None if terms.fit is None else terms.fit.coefficients,
  }


_NOT_MEASURED = "the accumulator sits inside your optimizer"


def _rel(a: Any, b: Any) -> float:
  diff = jax.tree.map(jnp.subtract, f32(a), f32(b))
  return float(optax.tree.norm(diff) / jnp.maximum(optax.tree.norm(f32(b)), 1e-30))

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
  compare_params,
  fit_gradient,
  leaf_names,
  rounding_level_leaves,
)
from optax_accum._audit_report import AuditReport, Verdict, lr_labels
from optax_accum._audit_runs import (
  GradFn,
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
from optax_accum._audit_setups import Accumulation, Setup, check_loss_fn, resolve_setup
from optax_accum._audit_verdicts import Evidence, verdicts
from optax_accum._batching import split_micro_batches

__all__ = ["Accumulation", "AuditReport", "Verdict", "audit"]


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
  k = _checks.whole_number(k, name="k")
  steps = _checks.whole_number(steps, name="steps")
  batches, micro = _micro_batches(batch, k, steps, split)
  check_loss_fn(loss_fn, has_aux, params, micro[0][0])
  has_aux = bool(has_aux)
  setup = resolve_setup(loss_fn, has_aux, optimizer, params, k, accumulation)
  grad_fn = gradient_fn(loss_fn, has_aux)
  first = _first_batch(grad_fn, params, batches[0], micro[0])
  probe = gradient_probe(setup.accumulation, k, first.params32, micro[0])
  fit = fit_gradient(
    probe.applied, first.whole_grad, first.micro_grads, first.tokens, tolerance
  )
  reference, resummed, run = _runs(setup, grad_fn, params, batches, micro, k)
  lowest = min(jnp.finfo(jnp.result_type(x)).eps for x in jax.tree.leaves(params))
  trajectory_tol = max(tolerance, 32 * float(lowest))
  skip = rounding_level_leaves(first.whole_grad, first.resummed_grad)
  comparison = compare_params(
    reference.params, resummed.params, run.params, skip, trajectory_tol
  )
  evidence = Evidence(fit, probe.changed, comparison, reference, run, steps)
  names = leaf_names(params)
  rounding_leaves = [names[i] for i in skip]
  report = _report(setup.name, first, evidence, rounding_leaves, trajectory_tol)
  report.verdicts = verdicts(report, evidence)
  return report


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
    resummed_grad: The micro-batch gradients' token-weighted mean: the whole
      batch's gradient summed in another order.
    uniform_grad: Their plain mean, what F1 applies.
  """

  params32: Any
  whole_grad: Any
  micro_grads: list[Any]
  tokens: list[float]
  resummed_grad: Any
  uniform_grad: Any


def _first_batch(
  grad_fn: GradFn, params: Any, batch: Any, window: Sequence[Any]
) -> _FirstBatch:
  params32 = f32(params)
  whole_grad, _ = grad_fn(params32, batch)
  pairs = [grad_fn(params32, m) for m in window]
  micro_grads = [g for g, _ in pairs]
  tokens = [float(w) for _, w in pairs]
  if not sum(tokens) > 0:
    raise ValueError(f"The first batch holds no tokens: weights {tokens}.")
  resummed_grad = recombined(micro_grads, tokens, params32)
  k = len(micro_grads)
  uniform_grad = jax.tree.map(lambda *g: sum(g) / k, *micro_grads)
  return _FirstBatch(
    params32, whole_grad, micro_grads, tokens, resummed_grad, uniform_grad
  )


def _runs(
  setup: Setup,
  grad_fn: GradFn,
  params: Any,
  batches: list[Any],
  micro: list[list[Any]],
  k: int,
) -> tuple[Reference, Reference, SetupRun]:
  """The whole batch, its exact re-summation, and the setup, each on a copy."""
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
  return reference, resummed, run


def _report(
  name: str,
  first: _FirstBatch,
  evidence: Evidence,
  rounding_leaves: list[str],
  tolerance: float,
) -> AuditReport:
  """The report of the measurements, verdicts not yet drawn."""
  reference, run, fit = evidence.reference, evidence.run, evidence.fit
  k = len(first.tokens)
  labels = lr_labels(list(reference.learning_rates))
  return AuditReport(
    setup=name,
    k=k,
    tokens=first.tokens,
    mean_of_means_bias=_rel(first.uniform_grad, first.whole_grad),
    grad_error=fit.error,
    grad_fit=fit.describe,
    grad_scale=fit.scale,
    micro_batch_weights=fit.coefficients,
    params_diff=evidence.comparison.diff,
    rounding_diff=evidence.comparison.rounding,
    rounding_leaves=rounding_leaves,
    finite=run.nonfinite_at is None,
    reference_finite=reference.nonfinite_at is None,
    lr={
      labels[p]: [v[0] for v in values if v] for p, values in run.learning_rates.items()
    },
    lr_reference={labels[p]: v for p, v in reference.learning_rates.items()},
    changed=run.changed,
    expected_changes=[
      c for update in reference.changed for c in [False] * (k - 1) + [update]
    ],
    resumed=run.resumed,
    tolerance=tolerance,
  )


def _rel(a: Any, b: Any) -> float:
  diff = jax.tree.map(jnp.subtract, f32(a), f32(b))
  return float(optax.tree.norm(diff) / jnp.maximum(optax.tree.norm(f32(b)), 1e-30))

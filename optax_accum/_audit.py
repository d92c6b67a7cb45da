"""``audit``: check an accumulation setup against training on the whole batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum._batching import split_micro_batches
from optax_accum._inspect import get_hyperparams
from optax_accum._multi_steps import MultiSteps
from optax_accum._train_step import make_train_step

#: ``accumulation(optimizer, k) -> (init, step)`` with ``init(params) -> state``
#: and ``step(params, state, micro_batch) -> (params, state)``, one call per
#: micro-batch: the user's own accumulation, built around any optimizer.
Accumulation = Callable[[optax.GradientTransformation, int], tuple[Callable, Callable]]

FAILURES = {
  "F1": "mean of per-micro-batch means",
  "F3": "schedule stepped on micro-steps",
  "F4": "off-by-one window",
  "F6": "gradients dropped at the window boundary",
  "F7": "params frozen while the optimizer state advances",
  "other": "any other difference from the whole batch",
}
FIXES = {
  "F1": "pass each micro-batch's token count: optax_accum.MultiSteps(...).update("
  "grads, state, params, weight=n_tokens)",
  "F3": "wrap the schedule: optax_accum.progress_schedule(schedule), inside the "
  "accumulator",
  "F4": "let the optimizer state decide window ends: optax_accum.make_train_step",
  "F6": "accumulate every micro-batch into the window: optax_accum.MultiSteps",
  "F7": "apply every update the optimizer returns, in one step function: "
  "optax_accum.make_train_step",
  "other": "compare your loop with optax_accum.make_train_step, micro-step by "
  "micro-step",
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
    k: Micro-batches per update.
    tokens: Weight (tokens) of each micro-batch of the first window.
    mean_of_means_bias: Relative error, on this batch, of the uniform mean of
      micro-batch mean gradients against the whole-batch gradient: what F1
      would cost here.
    grad_error: Relative error of the first window's gradient that the setup
      applies, against the whole batch (measured with ``optax.sgd(1.0)``).
    mean_of_means_error: Relative error of that gradient against the uniform
      mean of micro-batch gradients (near 0: F1).
    last_micro_batch_error: Its error against the last micro-batch's gradient
      alone (near 0: F6).
    grad_scale: The factor ``c`` that best fits ``applied = c * whole``.
    params_diff: Relative params difference after ``steps`` updates.
    finite: Whether the accumulated run's params stayed finite.
    reference_finite: Whether the whole-batch run's did.
    lr: Learning rate at each window end, accumulated side (empty if the
      optimizer does not inject one).
    lr_reference: Learning rate at each whole-batch update.
    changed: For each micro-step, whether the params changed.
    expected_changes: Where they should change: the last micro-step of each
      window whose whole-batch update changed the params.
    verdicts: Failure id to :class:`Verdict`.
    tolerance: Relative error above which a difference counts.
  """

  k: int
  tokens: list[float]
  mean_of_means_bias: float
  grad_error: float
  mean_of_means_error: float
  last_micro_batch_error: float
  grad_scale: float
  params_diff: float
  finite: bool
  reference_finite: bool
  lr: list[float]
  lr_reference: list[float]
  changed: list[bool]
  expected_changes: list[bool]
  tolerance: float
  verdicts: dict[str, Verdict] = dataclasses.field(default_factory=dict)

  @property
  def ok(self) -> bool:
    """No failure found and the run matches the whole batch."""
    return all(v.status != "FOUND" for v in self.verdicts.values())

  def __str__(self) -> str:
    lines = [
      f"accumulation audit: k={self.k}, {len(self.changed) // self.k} updates "
      f"against the whole batch -> {'OK' if self.ok else 'PROBLEMS FOUND'}",
      f"  tokens per micro-batch     {[round(t) for t in self.tokens]}",
      f"  mean-of-means bias here    {self.mean_of_means_bias:.2e}",
      f"  first-window grad error    {self.grad_error:.2e}",
      f"  params diff after updates  {self.params_diff:.2e}",
    ]
    if self.lr:
      lines.append(f"  lr per update (yours)      {_short(self.lr)}")
      lines.append(f"  lr per update (reference)  {_short(self.lr_reference)}")
    lines.append(f"  params changed at          {_marks(self.changed)}")
    lines.append(f"  expected changes at        {_marks(self.expected_changes)}")
    for failure, verdict in self.verdicts.items():
      name = FAILURES[failure]
      lines.append(f"  {failure:<5} {name:<48} {verdict.status:<5} {verdict.detail}")
      if verdict.status == "FOUND":
        lines.append(f"        fix: {verdict.fix}")
    return "\n".join(lines)


def _short(values: Sequence[float]) -> str:
  return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def _marks(flags: Sequence[bool]) -> str:
  return "".join("U" if flag else "." for flag in flags)


def _f32(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _copy(tree: Any) -> Any:
  """A copy a donating step may consume without touching the caller's arrays."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _rel(a: Any, b: Any) -> float:
  diff = jax.tree.map(jnp.subtract, _f32(a), _f32(b))
  return float(optax.tree.norm(diff) / jnp.maximum(optax.tree.norm(_f32(b)), 1e-30))


def _differs(a: Any, b: Any) -> bool:
  return not all(
    np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def _finite(tree: Any) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(_f32(tree)))


def _lr(state: Any) -> float | None:
  try:
    hyperparams = get_hyperparams(state)
  except ValueError:
    return None
  return float(hyperparams["learning_rate"]) if "learning_rate" in hyperparams else None


def _default_accumulation(loss_fn: Callable[..., Any]) -> Accumulation:
  def accumulation(
    optimizer: optax.GradientTransformation, k: int
  ) -> tuple[Callable, Callable]:
    opt = MultiSteps(optimizer, k)
    train_step = make_train_step(loss_fn, opt)

    def step(params: Any, state: Any, micro_batch: Any) -> tuple[Any, Any]:
      params, state, _ = train_step(params, state, micro_batch)
      return params, state

    return opt.init, step

  return accumulation


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
  side feeds the same data as ``k`` micro-batches per update through
  ``accumulation`` (by default :class:`optax_accum.MultiSteps` in
  :func:`optax_accum.make_train_step`; pass your own to audit it). It runs
  twice: around ``optax.sgd(1.0)`` on float32 copies of the params, which
  makes the first window's gradient visible, and around ``optimizer`` for
  ``steps`` updates. Every run gets its own copy of ``params``, so a setup that
  donates its buffers is fine.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, weight)``, the token-mean loss
      and the number of tokens, or ``(loss, (weight, aux))`` with ``has_aux``.
    optimizer: The optimizer, e.g. ``optax.inject_hyperparams(optax.adamw)(
      learning_rate=schedule)`` (inject it to have learning rates checked).
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
  """
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"`k` must be an int >= 1, got {k!r}.")
  if steps < 1:
    raise ValueError(f"`steps` must be >= 1, got {steps}.")
  batches = list(batch) if isinstance(batch, list) else [batch] * steps
  if len(batches) != steps:
    raise ValueError(f"`batch` holds {len(batches)} batches for steps={steps}.")
  if split is None:

    def split(b: Any, k: int) -> list[Any]:
      stacked = split_micro_batches(b, k)
      return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(k)]

  if has_aux:
    user_loss = loss_fn

    def loss_fn(params: Any, batch: Any) -> tuple[Any, Any]:
      loss, (weight, _) = user_loss(params, batch)
      return loss, weight

  accumulation = accumulation or _default_accumulation(loss_fn)
  grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True))

  # The batch itself: token counts and what F1 would cost on it (float32).
  params32 = _f32(params)
  micro = split(batches[0], k)
  if len(micro) != k:
    raise ValueError(f"`split` returned {len(micro)} micro-batches for k={k}.")
  whole_grad, _ = grad_fn(params32, batches[0])
  micro_grads = [grad_fn(params32, m) for m in micro]
  tokens = [float(w) for _, w in micro_grads]
  uniform = jax.tree.map(lambda *g: sum(g) / k, *[g for g, _ in micro_grads])

  # The first window's gradient, through the setup around sgd(1.0).
  init, step = accumulation(optax.sgd(1.0), k)
  probe = _copy(params32)
  state = init(probe)
  for micro_batch in micro:
    probe, state = step(probe, state, micro_batch)
  applied = jax.tree.map(jnp.subtract, params32, _f32(probe))
  flat_applied = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(applied)])
  flat_whole = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(whole_grad)])
  scale = float(flat_applied @ flat_whole / jnp.maximum(flat_whole @ flat_whole, 1e-30))

  # The trajectory: the setup around the real optimizer against the whole batch.
  ref_state, ref_params = optimizer.init(params), params
  lr_reference, expected = [], []
  for b in batches:
    grads, _ = grad_fn(ref_params, b)
    updates, ref_state = optimizer.update(grads, ref_state, ref_params)
    new_params = optax.apply_updates(ref_params, updates)
    expected += [False] * (k - 1) + [_differs(new_params, ref_params)]
    ref_params = new_params
    lr = _lr(ref_state)
    if lr is not None:
      lr_reference.append(lr)
  init, step = accumulation(optimizer, k)
  current = _copy(params)
  state, lrs, changed = init(current), [], []
  for b in batches:
    for i, micro_batch in enumerate(split(b, k)):
      before = _copy(current)
      current, state = step(current, state, micro_batch)
      changed.append(_differs(current, before))
      lr = _lr(state)
      if i == k - 1 and lr is not None:
        lrs.append(lr)

  lowest = min(jnp.finfo(jnp.result_type(x)).eps for x in jax.tree.leaves(params))
  report = AuditReport(
    k=k,
    tokens=tokens,
    mean_of_means_bias=_rel(uniform, whole_grad),
    grad_error=_rel(applied, whole_grad),
    mean_of_means_error=_rel(applied, uniform),
    last_micro_batch_error=_rel(applied, micro_grads[-1][0]),
    grad_scale=scale,
    params_diff=_rel(current, ref_params),
    finite=_finite(current),
    reference_finite=_finite(ref_params),
    lr=lrs,
    lr_reference=lr_reference,
    changed=changed,
    expected_changes=expected,
    tolerance=max(tolerance, 32 * float(lowest)),
  )
  report.verdicts = _verdicts(report, tolerance)
  return report


def _verdicts(r: AuditReport, grad_tol: float) -> dict[str, Verdict]:
  """One verdict per failure id, from the measurements in ``r``."""
  v: dict[str, Verdict] = {}
  frozen = any(r.expected_changes) and not any(r.changed)
  v["F7"] = (
    Verdict("FOUND", "params never changed", FIXES["F7"])
    if frozen
    else Verdict("ok", "params changed" if any(r.changed) else "no update expected")
  )

  pairs = zip(r.changed, r.expected_changes, strict=True)
  mismatch = [i for i, (a, b) in enumerate(pairs) if a != b]
  if frozen:
    v["F4"] = Verdict("n/a", "no update to place")
  elif mismatch:
    i = mismatch[0]
    what = "changed" if r.changed[i] else "did not change"
    v["F4"] = Verdict(
      "FOUND",
      f"params {what} after micro-step {i + 1}; windows end every {r.k}",
      FIXES["F4"],
    )
  else:
    v["F4"] = Verdict("ok", "updates at window ends")

  if frozen or mismatch:
    v["F1"] = v["F6"] = Verdict(
      "n/a", "windows misaligned" if mismatch else "no update"
    )
  elif r.grad_error <= grad_tol:
    v["F1"] = Verdict("ok", f"gradient matches the whole batch ({r.grad_error:.1e})")
    v["F6"] = Verdict("ok", "every micro-batch is in the gradient")
  elif r.k > 1 and r.last_micro_batch_error <= grad_tol:
    v["F6"] = Verdict(
      "FOUND", "only the last micro-batch's gradient is applied", FIXES["F6"]
    )
    v["F1"] = Verdict("n/a", "gradient is the last micro-batch's")
  elif r.mean_of_means_error <= grad_tol:
    v["F1"] = Verdict(
      "FOUND",
      f"gradient off by {r.grad_error:.1e}: it is the mean of micro-batch means "
      f"(tokens {min(r.tokens):.0f}-{max(r.tokens):.0f})",
      FIXES["F1"],
    )
    v["F6"] = Verdict("ok", "every micro-batch is in the gradient")
  else:
    v["F1"] = v["F6"] = Verdict("n/a", "the gradient differs in another way")

  if not r.lr_reference or not r.lr:
    v["F3"] = Verdict("n/a", "no injected learning rate to compare")
  else:
    scale = max(max(abs(x) for x in r.lr_reference), 1e-12)
    worst = max(abs(a - b) for a, b in zip(r.lr, r.lr_reference, strict=True)) / scale
    v["F3"] = (
      Verdict("FOUND", f"learning rates differ by up to {worst:.1e}", FIXES["F3"])
      if worst > 1e-5
      else Verdict("ok", "learning rate n at update n")
    )

  explained = any(x.status == "FOUND" for x in v.values())
  problems = []
  if not r.finite:
    also = " (so did the whole batch's)" if not r.reference_finite else ""
    problems.append(f"params became non-finite{also}")
  if not explained and r.grad_error > grad_tol and v["F1"].status == "n/a":
    if abs(r.grad_scale - 1) > grad_tol and _scaled_fit(r):
      problems.append(f"the window gradient is {r.grad_scale:.3g}x the whole batch's")
    else:
      problems.append(f"the window gradient is off by {r.grad_error:.1e}")
  if not explained and r.params_diff > r.tolerance:
    problems.append(f"params end {r.params_diff:.1e} from the whole batch's")
  v["other"] = (
    Verdict("FOUND", "; ".join(problems), FIXES["other"])
    if problems
    else Verdict("ok", "nothing else differs")
  )
  return {failure: v[failure] for failure in FAILURES}


def _scaled_fit(r: AuditReport) -> bool:
  """Whether the applied gradient is a scaled whole-batch gradient."""
  # grad_error of c * g against g is |c - 1|; anything else adds to it.
  return abs(r.grad_error - abs(r.grad_scale - 1)) <= 1e-3 * max(r.grad_error, 1e-12)

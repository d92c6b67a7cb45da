"""``audit``: check an accumulation setup against training on the whole batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
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
    last_micro_batch_error: Relative error of that gradient against the last
      micro-batch's alone (near 0 means earlier micro-batches were dropped).
    params_diff: Relative params difference after ``steps`` updates.
    lr: Learning rate at each real update, accumulated side (empty if the
      optimizer does not inject one).
    lr_reference: The same for the whole batch.
    changed: For each micro-step, whether the params changed.
    expected_changes: Where they should change: the last micro-step of each
      window.
    verdicts: Failure id to :class:`Verdict`.
  """

  k: int
  tokens: list[float]
  mean_of_means_bias: float
  grad_error: float
  last_micro_batch_error: float
  params_diff: float
  lr: list[float]
  lr_reference: list[float]
  changed: list[bool]
  expected_changes: list[bool]
  verdicts: dict[str, Verdict]
  tolerance: float

  @property
  def ok(self) -> bool:
    """No failure found and the run matches the whole batch."""
    return all(v.status != "FOUND" for v in self.verdicts.values()) and (
      self.params_diff <= self.tolerance
    )

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
      lines.append(
        f"  {failure} {FAILURES[failure]:<48} {verdict.status:<5} {verdict.detail}"
      )
      if verdict.status == "FOUND":
        lines.append(f"     fix: {verdict.fix}")
    return "\n".join(lines)


def _short(values: Sequence[float]) -> str:
  return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def _marks(flags: Sequence[bool]) -> str:
  return "".join("U" if flag else "." for flag in flags)


def _rel(a: Any, b: Any) -> float:
  diff = jax.tree.map(
    lambda x, y: jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32), a, b
  )
  return float(optax.tree.norm(diff) / jnp.maximum(optax.tree.norm(b), 1e-30))


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
    train_step = make_train_step(loss_fn, opt, donate=False)

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
  tolerance: float = 1e-4,
) -> AuditReport:
  """Runs an accumulation setup and the whole batch side by side, and compares.

  The whole-batch side applies ``optimizer`` once per batch. The accumulated
  side feeds the same data as ``k`` micro-batches per update through
  ``accumulation`` (by default :class:`optax_accum.MultiSteps` in
  :func:`optax_accum.make_train_step`; pass your own to audit it). It is run
  twice: around ``optax.sgd(1.0)``, which makes the first window's gradient
  visible, and around ``optimizer`` for ``steps`` updates.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, weight)``: the token-mean loss
      and the number of tokens (as for :func:`make_train_step`).
    optimizer: The optimizer, e.g. ``optax.inject_hyperparams(optax.adamw)(
      learning_rate=schedule)`` (inject it to have learning rates checked).
    params: Initial params (not modified).
    batch: One batch (reused for every update) or a sequence of ``steps``
      batches, leaves with a leading batch axis.
    k: Micro-batches per update.
    steps: Updates to run.
    split: ``split(batch, k) -> micro-batches``; defaults to
      :func:`split_micro_batches`.
    accumulation: ``accumulation(optimizer, k) -> (init, step)``, your setup:
      ``init(params) -> state`` and ``step(params, state, micro_batch) ->
      (params, state)``, called once per micro-batch.
    tolerance: Relative error above which a difference counts.

  Returns:
    An :class:`AuditReport`; ``report.ok`` is a bool.
  """
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"`k` must be an int >= 1, got {k!r}.")
  if steps < 1:
    raise ValueError(f"`steps` must be >= 1, got {steps}.")
  batches = list(batch) if isinstance(batch, list | tuple) else [batch] * steps
  if len(batches) != steps:
    raise ValueError(f"`batch` holds {len(batches)} batches for steps={steps}.")
  if split is None:

    def split(b: Any, k: int) -> list[Any]:
      stacked = split_micro_batches(b, k)
      return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(k)]

  accumulation = accumulation or _default_accumulation(loss_fn)
  grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True))

  # The batch itself: token counts and what F1 would cost on it.
  micro = split(batches[0], k)
  if len(micro) != k:
    raise ValueError(f"`split` returned {len(micro)} micro-batches for k={k}.")
  whole_grad, _ = grad_fn(params, batches[0])
  micro_grads = [grad_fn(params, m) for m in micro]
  tokens = [float(w) for _, w in micro_grads]
  uniform = jax.tree.map(lambda *g: sum(g) / k, *[g for g, _ in micro_grads])
  bias = _rel(uniform, whole_grad)

  # The first window's gradient, through the setup around sgd(1.0).
  init, step = accumulation(optax.sgd(1.0), k)
  state, probe = init(params), params
  for micro_batch in micro:
    probe, state = step(probe, state, micro_batch)
  applied = jax.tree.map(lambda a, b: jnp.asarray(a) - jnp.asarray(b), params, probe)
  grad_error = _rel(applied, whole_grad)
  last_error = _rel(applied, micro_grads[-1][0])

  # The trajectory: the setup around the real optimizer against the whole batch.
  ref_state, ref_params, lr_reference = optimizer.init(params), params, []
  for b in batches:
    grads, _ = grad_fn(ref_params, b)
    updates, ref_state = optimizer.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    lr = _lr(ref_state)
    if lr is not None:
      lr_reference.append(lr)
  init, step = accumulation(optimizer, k)
  state, current, lrs, changed = init(params), params, [], []
  for b in batches:
    for micro_batch in split(b, k):
      before = current
      current, state = step(current, state, micro_batch)
      moved = any(
        bool(jnp.any(jnp.asarray(x) != jnp.asarray(y)))
        for x, y in zip(jax.tree.leaves(current), jax.tree.leaves(before), strict=True)
      )
      changed.append(moved)
      lr = _lr(state)
      if moved and lr is not None:
        lrs.append(lr)
  expected = [i % k == k - 1 for i in range(steps * k)]
  params_diff = _rel(current, ref_params)

  verdicts = _verdicts(
    tolerance,
    bias,
    grad_error,
    last_error,
    tokens,
    lrs,
    lr_reference,
    changed,
    expected,
  )
  return AuditReport(
    k=k,
    tokens=tokens,
    mean_of_means_bias=bias,
    grad_error=grad_error,
    last_micro_batch_error=last_error,
    params_diff=params_diff,
    lr=lrs,
    lr_reference=lr_reference,
    changed=changed,
    expected_changes=expected,
    verdicts=verdicts,
    tolerance=tolerance,
  )


def _verdicts(
  tol: float,
  bias: float,
  grad_error: float,
  last_error: float,
  tokens: list[float],
  lrs: list[float],
  lr_reference: list[float],
  changed: list[bool],
  expected: list[bool],
) -> dict[str, Verdict]:
  verdicts: dict[str, Verdict] = {}
  frozen = not any(changed)

  if frozen:
    verdicts["F7"] = Verdict("FOUND", "params never changed", FIXES["F7"])
  else:
    verdicts["F7"] = Verdict("ok", "params changed")

  if not frozen and changed != expected:
    first = changed.index(True) + 1
    verdicts["F4"] = Verdict(
      "FOUND",
      f"updates at other micro-steps (first after {first}, expected {len(tokens)})",
      FIXES["F4"],
    )
  elif frozen:
    verdicts["F4"] = Verdict("n/a", "no update to place")
  else:
    verdicts["F4"] = Verdict("ok", "updates at window ends")

  if frozen:
    verdicts["F6"] = verdicts["F1"] = Verdict("n/a", "no update to measure")
  elif verdicts["F4"].status == "FOUND":
    verdicts["F6"] = verdicts["F1"] = Verdict("n/a", "windows misaligned (F4)")
  elif grad_error <= tol:
    verdicts["F1"] = Verdict(
      "ok", f"gradient matches the whole batch ({grad_error:.1e})"
    )
    verdicts["F6"] = Verdict("ok", "every micro-batch is in the gradient")
  elif len(tokens) > 1 and last_error <= tol:
    verdicts["F6"] = Verdict(
      "FOUND", "only the last micro-batch's gradient is applied", FIXES["F6"]
    )
    verdicts["F1"] = Verdict("n/a", "gradient is the last micro-batch's")
  elif abs(grad_error - bias) <= max(0.05 * bias, tol):
    verdicts["F1"] = Verdict(
      "FOUND",
      f"gradient off by {grad_error:.1e}: the mean of micro-batch means "
      f"(tokens {min(tokens):.0f}-{max(tokens):.0f})",
      FIXES["F1"],
    )
    verdicts["F6"] = Verdict("ok", "every micro-batch is in the gradient")
  else:
    verdicts["F1"] = Verdict("FOUND", f"gradient off by {grad_error:.1e}", FIXES["F1"])
    verdicts["F6"] = Verdict("n/a", "gradient differs for another reason")

  if not lr_reference or not lrs:
    verdicts["F3"] = Verdict("n/a", "no injected learning rate to compare")
  else:
    n = min(len(lrs), len(lr_reference))
    worst = max(
      abs(a - b) / max(abs(b), 1e-12)
      for a, b in zip(lrs[:n], lr_reference[:n], strict=True)
    )
    if worst > 1e-5:
      verdicts["F3"] = Verdict(
        "FOUND", f"learning rates differ by up to {worst:.1e}", FIXES["F3"]
      )
    else:
      verdicts["F3"] = Verdict("ok", "learning rate n at update n")
  return {failure: verdicts[failure] for failure in FAILURES}

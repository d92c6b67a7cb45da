"""What the framework integrations (``optax_accum.flax``) require of an optimizer
and its arguments: checks shared by Linen and NNX, and the update of a plain
optax optimizer (a window of one micro-batch)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from optax_accum._core._checks import check_scalar
from optax_accum._core._hyperparams import find_states
from optax_accum._core._multi_steps import MultiStepsState


def find_accumulator(opt_state: Any, *, where: str) -> MultiStepsState | None:
  """The :class:`MultiStepsState` in ``opt_state``, or ``None`` for a plain
  optax optimizer; ``ValueError`` for an ``optax.MultiSteps``."""
  if find_states(opt_state, (optax.MultiStepsState,)):
    raise ValueError(
      f"{where} got an optax.MultiSteps, which ignores `weight` and averages "
      "micro-batch means uniformly: use optax_accum.MultiSteps (same arguments)."
    )
  found = find_states(opt_state, (MultiStepsState,))
  return found[0] if found else None


def check_accumulates(opt_state: Any, *, where: str) -> MultiStepsState:
  """The :class:`MultiStepsState` in ``opt_state``; ``ValueError`` if none."""
  found = find_accumulator(opt_state, where=where)
  if found is None:
    raise ValueError(
      f"{where} needs an optimizer that holds an optax_accum.MultiSteps, the "
      "accumulator that reads `weight`; got a state without one."
    )
  return found


def check_weight(weight: ArrayLike | None, *, where: str) -> None:
  """``ValueError`` if ``weight`` is missing: the wrappers have no default."""
  if weight is None:
    raise ValueError(
      f"{where} needs `weight=`: the count this micro-batch's loss divides by "
      "(valid tokens for a token mean, rows for a mean of per-row means, rows x "
      "length for a mean over all positions; for a loss divided by a constant "
      "or not at all, MultiSteps(..., grad_reduction='window_mean') and "
      "weight=1). weight=1 everywhere is optax.MultiSteps' uniform mean, exact "
      "only where every micro-batch's loss divides by the same count."
    )


def plain_update(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
  *,
  weight: ArrayLike | None,
  loss: ArrayLike | None,
  end_window: ArrayLike | None,
  extra_args: dict[str, Any],
) -> tuple[Any, Any, Any, jax.Array]:
  """One step of a plain optax optimizer: a window of one micro-batch.

  The update is Flax's own (``tx.update``, then ``optax.apply_updates``), so
  params and state are bit-identical to ``nnx.Optimizer`` and Linen's
  ``TrainState``. ``weight`` changes nothing in it; a zero, negative, NaN or
  inf ``weight`` drops the micro-batch, as ``MultiSteps(tx, 1)`` does (a window
  of no items): params and state are returned as they are and no update is
  counted. ``loss`` goes to ``tx`` as ``value`` (the window's loss).
  ``end_window`` is checked and changes nothing: every window ends.

  Returns:
    ``(updates, opt_state, params, updated)``: the updates applied (zeros for
    a dropped micro-batch), the new state and params, and a bool scalar.
  """
  extra = dict(extra_args)
  if loss is not None:
    if "value" in extra:
      raise ValueError(
        "Pass the micro-batch's loss as `loss=` or `value=`, not both: "
        "`loss=` is passed to the optimizer as `value`."
      )
    check_scalar(loss, name="loss", dtype=jnp.float32)
    extra["value"] = loss
  if end_window is not None:
    check_scalar(end_window, name="end_window", dtype=jnp.bool_)
  inner = optax.with_extra_args_support(tx) if extra else tx

  def run(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any, Any]:
    updates, opt_state = inner.update(grads, opt_state, params, **extra)
    return updates, opt_state, optax.apply_updates(params, updates)

  def drop(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any, Any]:
    shapes = jax.eval_shape(run, grads, opt_state, params)[0]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return zeros, opt_state, params

  if weight is None:
    return (*run(grads, opt_state, params), jnp.asarray(True))
  check_scalar(weight, name="weight", dtype=jnp.float32)
  w = jnp.asarray(weight)
  ok = (w > 0) & jnp.isfinite(w)
  try:  # A weight known now (eagerly, or a constant): Flax's own ops, no cond.
    known = bool(ok)
  except jax.errors.ConcretizationTypeError:
    pass
  else:
    if known:
      return (*run(grads, opt_state, params), ok)
    return (*drop(grads, opt_state, params), ok)
  return (*jax.lax.cond(ok, run, drop, grads, opt_state, params), ok)

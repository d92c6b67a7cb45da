"""Errors that name the cause when a train step is given what it cannot take.

JAX's own messages name none of the step's arguments: a buffer an earlier call
donated ("Array has been deleted"), a whole train state as ``params`` ("grad
requires real- or complex-valued inputs"), a checkpoint restored without a
target. The checks run only once a call has failed: a working call pays nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from optax_accum._core import _checks
from optax_accum._core._placement import traced
from optax_accum._core._state import MultiStepsState, check_not_holding

F = TypeVar("F", bound=Callable[..., Any])


def explained(call: F) -> F:
  """``call`` (a step's ``__call__``) re-raising known failures as clear errors."""

  @functools.wraps(call)
  def checked(
    self: Any, params: Any, opt_state: Any, batch: Any, *args: Any, **kw: Any
  ) -> Any:
    try:
      return call(self, params, opt_state, batch, *args, **kw)
    except (RuntimeError, TypeError, ValueError) as e:
      check_not_a_train_state(params)
      if any(word in str(e) for word in ("deleted", "donated")):
        check_not_donated(params=params, opt_state=opt_state, batch=batch)
      raise

  return checked  # type: ignore[return-value]


def check_not_a_train_state(params: Any) -> None:
  """``ValueError`` if ``params`` is a whole train state (Flax's or ours)."""
  if all(hasattr(params, name) for name in ("params", "opt_state", "tx")):
    raise ValueError(
      f"`params` is a {type(params).__name__}, a whole train state (params, "
      "opt_state, step, tx), not the params: call step(state.params, "
      "opt_state, batch) with an opt_state from step.init(state.params), or "
      "use the train state's own apply_gradients(grads=g, weight=n) "
      "(optax_accum.flax.TrainState)."
    )


def check_not_donated(**trees: Any) -> None:
  """``ValueError`` naming the first deleted leaf of ``trees`` (by argument)."""
  for name, tree in trees.items():
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ValueError(
          f"`{name}` leaf {jax.tree_util.keystr(path)} was deleted: a step "
          "donates its params and opt_state to the program they go into "
          "(make_train_step(..., donate=True), the default), so an earlier "
          "call's inputs are gone once it has run. Pass the params and "
          "opt_state the last call returned, or build the step with "
          "donate=False to keep its inputs (a copy a call)."
        )


def check_restored(opt_state: Any) -> None:
  """``ValueError`` if ``opt_state`` is a checkpoint restored without a target."""
  fields = set(MultiStepsState._fields) - {"noise_scale", "held"}  # Optional.
  if isinstance(opt_state, dict) and fields <= set(opt_state):
    raise ValueError(
      "`opt_state` is a dict with the fields of a MultiStepsState: a checkpoint "
      "restored without a target. Restore it against the state you started "
      'from, ckpt.restore(path, {"params": params, "opt_state": '
      "step.init(params), ...}), or against optax_accum.resume_target("
      "step.init(params), saved) on other devices (docs/checkpointing.md)."
    )


def check_state(opt_state: Any) -> None:
  """``ValueError`` unless ``opt_state`` is a :class:`MultiStepsState` that
  holds no streamed coupled window."""
  if isinstance(opt_state, MultiStepsState):
    check_not_holding(opt_state, "this train step")
    return
  check_restored(opt_state)
  raise ValueError(
    "`opt_state` must come from step.init(params) (or optimizer.init(params) "
    "of the optax_accum.MultiSteps given to make_train_step; in scan mode "
    "also the inner optimizer's own tx.init(params)), got "
    f"{type(opt_state).__module__}.{type(opt_state).__qualname__}."
  )


def check_counts_keys(opt_state: Any, rng: Any) -> None:
  """``ValueError`` for ``rng`` with a state that counts no micro-batches (the
  inner optimizer's own): every window would draw the same keys."""
  if rng is not None and not isinstance(opt_state, MultiStepsState):
    raise ValueError(
      "`rng` needs a state that counts the run's micro-batches, and the inner "
      "optimizer's own state (tx.init(params)) counts none: every window "
      "would draw the same keys. Start from step.init(params)."
    )


def check_end_window(end_window: Any, scan: bool) -> None:
  """``ValueError`` unless ``end_window`` is a scalar bool, and ``False`` in
  scan mode. Checked on every micro-step, not only the last."""
  if end_window is False:
    return
  _checks.check_scalar(end_window, name="end_window", dtype=jnp.bool_)
  if scan and (traced(end_window) or bool(end_window)):
    raise ValueError(
      "`end_window` is for streaming: in scan mode every call ends a window."
    )

"""What the framework integrations (``optax_accum.flax``) require of an optimizer
and its arguments: checks shared by Linen and NNX."""

from __future__ import annotations

from typing import Any

import optax
from jax.typing import ArrayLike

from optax_accum._core._hyperparams import find_states
from optax_accum._core._multi_steps import MultiStepsState


def check_accumulates(opt_state: Any, *, where: str) -> MultiStepsState:
  """The :class:`MultiStepsState` in ``opt_state``; ``ValueError`` if none."""
  if find_states(opt_state, (optax.MultiStepsState,)):
    raise ValueError(
      f"{where} got an optax.MultiSteps, which ignores `weight` and averages "
      "micro-batch means uniformly: use optax_accum.MultiSteps (same arguments)."
    )
  found = find_states(opt_state, (MultiStepsState,))
  if not found:
    raise ValueError(
      f"{where} needs an optimizer that holds an optax_accum.MultiSteps, the "
      "accumulator that reads `weight`; got a state without one."
    )
  return found[0]


def check_weight(weight: ArrayLike | None, *, where: str) -> None:
  """``ValueError`` if ``weight`` is missing: the wrappers have no default."""
  if weight is None:
    raise ValueError(
      f"{where} needs `weight=`: the number of items (tokens, samples) behind "
      "this micro-batch's gradient. Without it every micro-batch weighs the same "
      "and short ones count too much; pass weight=1 if that is what you want "
      "(optax.MultiSteps' uniform mean)."
    )


def check_update(opt_state: Any, weight: ArrayLike | None, *, where: str) -> None:
  """Refuses an update the wrappers would get silently wrong.

  ``ValueError`` if ``opt_state`` holds no optax_accum accumulator (see
  :func:`check_accumulates`) or ``weight`` is missing.
  """
  check_accumulates(opt_state, where=where)
  check_weight(weight, where=where)

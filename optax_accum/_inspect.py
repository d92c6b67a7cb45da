"""Read hyperparameters and update counts out of any optimizer state, for logging."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum._multi_steps import MultiStepsState
from optax_accum._schedules import ProgressState

_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)
# Where the number of applied updates lives, most trustworthy first: an
# accumulator counts windows; a progress schedule counts updates even when its
# optimizer is called on every micro-step; an injected optimizer's own count
# only counts calls.
_COUNTERS: tuple[tuple[type, str], ...] = (
  (MultiStepsState, "gradient_step"),
  (optax.MultiStepsState, "gradient_step"),
  (ProgressState, "updates"),
  (optax.InjectStatefulHyperparamsState, "count"),
  (optax.InjectHyperparamsState, "count"),
)


def _find(state: Any, types: tuple[type, ...]) -> list[Any]:
  """Nodes of ``state`` that are instances of ``types``, outermost first."""
  nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, types))
  return [node for node in nodes if isinstance(node, types)]


def get_hyperparams(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """The hyperparameters injected anywhere in an optimizer state.

  Works on any nesting (``optax.chain``, :class:`optax_accum.MultiSteps`,
  ``optax.MultiSteps``, ``nnx.Optimizer.opt_state``), inside or outside
  ``jit``. The values are those the last applied update used (before any
  update: the first update's). ``learning_rate`` comes first when present;
  where several ``inject_hyperparams`` define the same name (the branches of
  ``optax.multi_transform``), the first in tree order is reported.

  Args:
    opt_state: The state of any optimizer.

  Returns:
    A dict from hyperparameter name to its scalar value.

  Raises:
    ValueError: If no ``optax.inject_hyperparams`` state is found.

  Examples:
    >>> import optax, optax_accum
    >>> opt = optax.chain(
    ...     optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0),
    ...     optax.inject_hyperparams(optax.sgd)(momentum=0.9, learning_rate=0.1))
    >>> hyperparams = optax_accum.get_hyperparams(opt.init(0.0))
    >>> {name: round(float(value), 6) for name, value in hyperparams.items()}
    {'learning_rate': 0.1, 'max_norm': 1.0, 'momentum': 0.9}
  """
  found = _find(opt_state, _INJECTED)
  if not found:
    raise ValueError(
      "No hyperparameters in this optimizer state: wrap the optimizer in "
      "optax.inject_hyperparams to make its learning rate visible."
    )
  hyperparams: dict[str, jax.Array] = {}
  for node in found:
    for name, value in node.hyperparams.items():
      hyperparams.setdefault(name, jnp.asarray(value))  # Unwraps nnx variables.
  if "learning_rate" in hyperparams:
    hyperparams = {"learning_rate": hyperparams.pop("learning_rate"), **hyperparams}
  return hyperparams


def get_update_count(opt_state: optax.OptState) -> jax.Array:
  """The number of optimizer updates applied, found in any optimizer state.

  Reads, in order of preference, the window count of an ``optax_accum`` or
  ``optax`` ``MultiSteps``, the update count of a :func:`progress_schedule`,
  and the call count of ``optax.inject_hyperparams``. Inside or outside
  ``jit``.

  Args:
    opt_state: The state of any optimizer.

  Returns:
    An int32 scalar.

  Raises:
    ValueError: If the state holds none of these counters.

  Examples:
    >>> import optax, optax_accum
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> state = opt.init(0.0)
    >>> for _ in range(5):
    ...   _, state = opt.update(1.0, state)
    >>> int(optax_accum.get_update_count(state))
    2
  """
  for node_type, field in _COUNTERS:
    found = _find(opt_state, (node_type,))
    if found:
      return jnp.asarray(getattr(found[0], field))
  raise ValueError(
    "No update counter in this optimizer state: expected an optax_accum or "
    "optax MultiSteps, a progress_schedule, or optax.inject_hyperparams."
  )

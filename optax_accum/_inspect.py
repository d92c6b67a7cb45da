"""Read hyperparameters, update counts and window losses out of any optimizer
state, for logging and evaluation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import ScheduleFreeState

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


def find_states(state: Any, types: tuple[type, ...]) -> list[Any]:
  """Nodes of ``state`` that are instances of ``types``, outermost first."""
  nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, types))
  return [node for node in nodes if isinstance(node, types)]


def _injected(state: Any, groups: str = "") -> list[tuple[str, str, Any]]:
  """Every injected-hyperparams state in tree order, with two labels: the
  ``multi_transform`` groups it sits in (``"head"``, ``"encoder/attention"``;
  its path in ``state`` outside any), and those groups followed by its path
  in the innermost group's state."""
  types = (*_INJECTED, optax.MultiTransformState)
  leaves = jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: isinstance(x, types)
  )[0]
  found: list[tuple[str, str, Any]] = []
  for path, node in leaves:
    if isinstance(node, optax.MultiTransformState):
      for group, inner in node.inner_states.items():
        found += _injected(inner, f"{groups}/{group}" if groups else str(group))
    elif isinstance(node, _INJECTED):
      where = jax.tree_util.keystr(path)
      found.append((groups or where, groups + where, node))
  return found


def get_hyperparams(opt_state: optax.OptState) -> dict[str, Any]:
  """The hyperparameters injected anywhere in an optimizer state.

  Works on any nesting (``optax.chain``, :class:`optax_accum.MultiSteps`,
  ``optax.MultiSteps``, ``optax.multi_transform``,
  ``nnx.Optimizer.opt_state``), inside or outside ``jit``. The values are
  those the last applied update used (before any update: the first update's).
  ``learning_rate`` comes first when present.

  A name that one ``inject_hyperparams`` defines maps to its scalar value. A
  name that several define (the groups of an ``optax.multi_transform``)
  maps to a dict of every one of them in tree order, keyed by group label
  (nested groups joined with ``/``), or where that is missing or shared by
  the injected state's path (``"[1]"`` for the second member of a chain,
  appended to the label inside a group).

  Args:
    opt_state: The state of any optimizer.

  Returns:
    A dict from hyperparameter name to its scalar value, or to a dict of
    scalar values by group label.

  Raises:
    ValueError: If no ``optax.inject_hyperparams`` state is found.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> opt = optax.chain(
    ...     optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0),
    ...     optax.inject_hyperparams(optax.sgd)(momentum=0.9, learning_rate=0.1))
    >>> hyperparams = optax_accum.get_hyperparams(opt.init(0.0))
    >>> {name: round(float(value), 6) for name, value in hyperparams.items()}
    {'learning_rate': 0.1, 'max_norm': 1.0, 'momentum': 0.9}

    Two ``multi_transform`` groups with their own learning rates:

    >>> opt = optax.multi_transform(
    ...     {"body": optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
    ...      "head": optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)},
    ...     {"w": "body", "b": "head"})
    >>> lr = optax_accum.get_hyperparams(opt.init({"w": 0.0, "b": 0.0}))
    >>> {group: round(float(value), 6) for group, value in lr["learning_rate"].items()}
    {'body': 0.01, 'head': 0.5}
  """
  found = _injected(opt_state)
  if not found:
    raise ValueError(
      "No hyperparameters in this optimizer state: wrap the optimizer in "
      "optax.inject_hyperparams to make its learning rate visible."
    )
  by_name: dict[str, list[tuple[str, str, jax.Array]]] = {}
  for short, full, node in found:
    for name, value in node.hyperparams.items():
      # jnp.asarray unwraps nnx variables.
      by_name.setdefault(name, []).append((short, full, jnp.asarray(value)))
  hyperparams: dict[str, Any] = {}
  for name, values in by_name.items():
    if len(values) == 1:
      hyperparams[name] = values[0][2]
      continue
    shorts = [short for short, _, _ in values]
    hyperparams[name] = {
      short if shorts.count(short) == 1 else full: value
      for short, full, value in values
    }
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
    found = find_states(opt_state, (node_type,))
    if found:
      return jnp.asarray(getattr(found[0], field))
  raise ValueError(
    "No update counter in this optimizer state: expected an optax_accum or "
    "optax MultiSteps, a progress_schedule, or optax.inject_hyperparams."
  )


def get_last_window(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """The loss and total weight of the window that ended last.

  For loops that call ``MultiSteps.update(..., loss=l)`` (an
  ``nnx.Optimizer``, a Linen ``TrainState``): on the micro-step that applies
  the update the running ``acc_loss`` and ``acc_weight`` are already reset,
  while these stay until the next window ends. Finds the
  :class:`optax_accum.MultiStepsState` anywhere in ``opt_state``, inside or
  outside ``jit``.

  Args:
    opt_state: The state of an optimizer holding an :class:`optax_accum.MultiSteps`.

  Returns:
    ``{"loss": ..., "weight": ...}``: the window's loss
    (:meth:`MultiSteps.window_loss`; 0 without ``loss=``) and total weight,
    both 0 before the first window ends.

  Raises:
    ValueError: If there is no :class:`optax_accum.MultiStepsState`.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> state = opt.init(jnp.zeros(()))
    >>> for loss, tokens in [(3.0, 1), (1.0, 3)]:
    ...   _, state = opt.update(jnp.array(1.0), state, weight=tokens, loss=loss)
    >>> window = optax_accum.get_last_window(state)
    >>> float(window["loss"]), float(window["weight"])  # (3 * 1 + 1 * 3) / 4
    (1.5, 4.0)
  """
  found = find_states(opt_state, (MultiStepsState,))
  if not found:
    raise ValueError(
      "No optax_accum.MultiStepsState in this optimizer state: the window's "
      "loss is kept by optax_accum.MultiSteps."
    )
  return {
    "loss": jnp.asarray(found[0].last_window_loss),
    "weight": jnp.asarray(found[0].last_window_weight),
  }


def schedule_free_eval_params(
  opt_state: optax.OptState, params: optax.Params
) -> optax.Params:
  """``optax.contrib.schedule_free_eval_params`` for a state that holds one.

  The optax function needs the ``schedule_free`` state itself; inside
  :class:`optax_accum.MultiSteps` (or a ``chain``, an ``nnx.Optimizer``) it
  sits deeper. This finds it anywhere in ``opt_state``.

  Args:
    opt_state: The state of an optimizer holding ``optax.contrib.schedule_free``
      (``schedule_free_adamw``, ``schedule_free_sgd``).
    params: The params being trained.

  Returns:
    The params to evaluate the model with.

  Raises:
    ValueError: If there is no schedule-free state, or several.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> opt = optax_accum.MultiSteps(
    ...     optax.contrib.schedule_free_sgd(1.0, b1=0.5), every_k_schedule=2)
    >>> params = jnp.zeros(())
    >>> state = opt.init(params)
    >>> for grad in [1.0, 1.0, 2.0, 2.0]:  # Two windows.
    ...   updates, state = opt.update(jnp.array(grad), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> float(params), float(optax_accum.schedule_free_eval_params(state, params))
    (-2.5, -2.0)
  """
  found = find_states(opt_state, (ScheduleFreeState,))
  if len(found) != 1:
    raise ValueError(
      "schedule_free_eval_params needs exactly one optax.contrib.schedule_free "
      f"state in `opt_state`, found {len(found)}."
    )
  state = jax.tree.map(jnp.asarray, found[0])  # Unwraps nnx variables.
  return optax.contrib.schedule_free_eval_params(state, params)

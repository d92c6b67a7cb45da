"""Read an optimizer state tree: the nodes of a type, the injected hyperparameters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def find_states(state: Any, types: tuple[type, ...]) -> list[Any]:
  """Nodes of ``state`` that are instances of ``types``, outermost first."""
  nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, types))
  return [node for node in nodes if isinstance(node, types)]


def _injected(state: Any, groups: str = "") -> Iterator[tuple[str, str, Any]]:
  """``(short, full, node)`` for each injected-hyperparams state in tree order:
  ``short`` its ``multi_transform`` groups (``"encoder/attention"``; outside
  any, its path), ``full`` the groups, then its path in the innermost group."""
  types = (*_INJECTED, optax.MultiTransformState)
  leaves = jax.tree.leaves_with_path(state, is_leaf=lambda x: isinstance(x, types))
  for path, node in leaves:
    if isinstance(node, optax.MultiTransformState):
      for group, inner in node.inner_states.items():
        yield from _injected(inner, f"{groups}/{group}" if groups else str(group))
    elif isinstance(node, _INJECTED):
      where = jax.tree_util.keystr(path)
      yield groups or where, groups + where, node


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
  if not (found := list(_injected(opt_state))):
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
  for name in sorted(by_name, key=lambda name: name != "learning_rate"):
    shorts = [short for short, _, _ in by_name[name]]
    labelled = {s if shorts.count(s) == 1 else f: v for s, f, v in by_name[name]}
    hyperparams[name] = by_name[name][0][2] if len(shorts) == 1 else labelled
  return hyperparams

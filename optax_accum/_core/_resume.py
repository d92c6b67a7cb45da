"""A restore target for a checkpoint taken in any layout, on any devices.

A checkpoint's layout (per-replica sums of shape ``(8, ...)`` for 8 replicas)
may fit no target from ``step.init(params)`` on the devices you resume on:
:func:`resume_target` builds one.

Examples:
  A state saved with 8 replicas' partial sums, resumed on one device:

  >>> import jax, numpy as np, optax, optax_accum
  >>> from optax_accum._core import _layout
  >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
  >>> here = opt.init({"w": np.zeros(3, np.float32)})
  >>> saved = here._replace(
  ...   acc_grads=_layout.PerReplica({"w": np.zeros((8, 3), np.float32)}, ("data",)))
  >>> target = resume_target(here, saved)
  >>> target.acc_grads.sums["w"].shape
  (8, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from optax_accum._core import _layout
from optax_accum._core._layout import Packed, PerReplica
from optax_accum._core._state import MultiStepsState


def resume_target(state: MultiStepsState, saved: Any) -> MultiStepsState:
  """``state`` as the target to restore a checkpoint of ``saved``'s layout.

  Args:
    state: The state you would start from where you resume (``step.init(params)``
      or ``opt.init(params)`` on the devices you resume on).
    saved: The saved optimizer state, or its checkpoint metadata: orbax's
      ``ckpt.metadata(path).item_metadata["opt_state"]`` (anything with the
      saved ``acc_grads``' fields and shapes).

  Returns:
    ``state`` with its accumulator in the saved layout, as host arrays of the
    saved shapes (zeros, for the restore to fill), and the saved ``held``
    micro-batches of a streamed coupled window likewise; every other field
    as it is. Pass what the restore returns to the step: it lays the sums out for
    its devices (for your own ``jit``, first
    ``optax_accum.relayout(restored, step.init(params))``).

  Raises:
    ValueError: if ``saved`` holds packed sums (:class:`~optax_accum.Packed`,
      written before packing was removed) that are not of these params.
  """
  held = _field(saved, "held", None)
  if held is not None:  # A streamed coupled window's micro-batches.
    held = tuple(jax.tree.map(_zeros, list(held), is_leaf=_is_array))
    state = state._replace(held=held)
  acc = _field(saved, "acc_grads")
  shapes = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype),
    _layout.one_sum_shapes(state.acc_grads),
  )
  groups = _field(acc, "groups", None)
  if groups is not None:
    return state._replace(acc_grads=_packed(shapes, groups))
  sums = _field(acc, "sums", None)
  if sums is None:  # One sum.
    return state._replace(acc_grads=jax.tree.map(_zeros, shapes))
  replicas = int(np.shape(_leaves(sums)[0])[0])
  stacked = jax.tree.map(lambda s: np.zeros((replicas, *s.shape), s.dtype), shapes)
  given = state.acc_grads
  axes = given.axes if isinstance(given, PerReplica) else _field(acc, "axes", ())
  return state._replace(acc_grads=PerReplica(stacked, tuple(axes)))


def _packed(shapes: Any, groups: Any) -> Packed:
  """A target for a checkpoint's packed sums (written before packing was
  removed): the packing ``step.init`` gave these params, its group sizes the
  saved ones."""
  packing = _layout.packing_of(shapes)
  saved = [int(np.prod(np.shape(g))) for g in _leaves(groups)]
  if packing is None or [packing.size(g) for g in packing.groups] != saved:
    raise ValueError(
      f"`saved` is packed in groups of {saved} elements, which step.init did "
      "not give these params: it holds the sums of other params. Restore it "
      "against a state of the params it was saved with."
    )
  leaves = [_zeros(s) for s in jax.tree.leaves(shapes)]
  return Packed(
    tuple(np.zeros(packing.size(g), leaves[g[0]].dtype) for g in packing.groups),
    tuple(leaves[i] for i in packing.rest),
    packing,
  )


def _field(tree: Any, name: str, *default: Any) -> Any:
  """A field of a state, a layout node or a checkpoint's metadata (a dict)."""
  if isinstance(tree, Mapping):
    return tree[name] if name in tree or not default else default[0]
  return getattr(tree, name, *default)


def _is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _leaves(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree, is_leaf=_is_array)


def _zeros(shape: jax.ShapeDtypeStruct) -> np.ndarray:
  return np.zeros(shape.shape, shape.dtype)

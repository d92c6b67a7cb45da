"""Packed sums, only restored: checkpoints written before packing was removed.

Such a checkpoint holds ``groups`` (one flat buffer per group of small leaves,
concatenated in tree order) and ``rest`` (the other leaves). It restores
against :func:`~optax_accum.resume_target`'s target and becomes one sum on
the step's first call or through :func:`~optax_accum.relayout`
(``_storage`` matches it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._core import _backend
from optax_accum._core._state import StoredNode


class Packing(NamedTuple):
  """Which accumulator leaves shared a buffer, and their shapes."""

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]  # Each leaf's own shape, in tree order.
  groups: tuple[tuple[int, ...], ...]  # Leaf indices, one buffer each.
  rest: tuple[int, ...]  # The leaves kept as they were.

  def size(self, group: tuple[int, ...]) -> int:
    return sum(math.prod(self.shapes[i]) for i in group)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["groups", "rest"],
  meta_fields=["packing"],
)
@dataclasses.dataclass(frozen=True)
class Packed(StoredNode):
  """Packed sums, as checkpoints written before packing was removed hold them:
  ``groups`` (one flat buffer per group, its leaves concatenated in tree order)
  and ``rest`` (the other leaves, in tree order). Only restored
  (:func:`~optax_accum.resume_target`), then made one sum."""

  groups: tuple[Any, ...]
  rest: tuple[Any, ...]
  packing: Packing
  contents: ClassVar[str] = (
    "packed sums (restored from a checkpoint written before packing was removed)"
  )


def packing_of(shapes: Any) -> Packing:
  """How ``step.init`` packed the sums ``shapes`` (one sum) on one CPU device
  before packing was removed (no groups if it did not): leaves of 1 to 4096
  elements, by dtype where a dtype had at least 16, in consecutive groups of
  at most 8192 elements."""
  flat, treedef = jax.tree.flatten(shapes)
  sizes = [tuple(np.shape(x)) for x in flat]
  by_dtype: dict[Any, list[int]] = {}
  for i, leaf in enumerate(flat):
    if 1 <= math.prod(sizes[i]) <= 4096:
      by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)
  chosen = (g for g in by_dtype.values() if len(g) >= 16)
  groups = tuple(
    g for c in chosen for g in _backend.consecutive(c, sizes, 8192) if len(g) > 1
  )
  rest = tuple(i for i in range(len(flat)) if not any(i in g for g in groups))
  return Packing(treedef, tuple(sizes), groups, rest)


def unpacked(acc: Packed) -> Any:
  """Every leaf in its own shape (on the host if it is there)."""
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(acc)):
    return jax.eval_shape(unpacked, acc)
  on_host = all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(acc))
  xp = np if on_host else jnp
  packing = acc.packing
  out = dict(zip(packing.rest, acc.rest, strict=True))
  for group, buffer in zip(packing.groups, acc.groups, strict=True):
    start = 0
    for i in group:
      stop = start + math.prod(packing.shapes[i])
      out[i] = xp.reshape(buffer[start:stop], packing.shapes[i])
      start = stop
  return jax.tree.unflatten(packing.treedef, [out[i] for i in range(len(out))])


def restore_target(shapes: Any, sizes: list[int]) -> Packed:
  """Host zeros packed as ``step.init`` packed sums of ``shapes``, whose group
  sizes a checkpoint says are ``sizes``."""
  packing = packing_of(shapes)
  if not packing.groups or [packing.size(g) for g in packing.groups] != sizes:
    raise ValueError(
      f"`saved` is packed in groups of {sizes} elements, which step.init did "
      "not give these params: it holds the sums of other params. Restore it "
      "against a state of the params it was saved with."
    )
  flat = [np.zeros(s.shape, s.dtype) for s in jax.tree.leaves(shapes)]
  return Packed(
    tuple(np.zeros(packing.size(g), flat[g[0]].dtype) for g in packing.groups),
    tuple(flat[i] for i in packing.rest),
    packing,
  )

"""A layout new to the library, in one file and without editing it: the
window's sums stored as a flat tuple of leaves (``Flat``) between calls.

Registering it is all the library needs: every path finds it through the
layouts protocol (``tests/test_layout_protocol.py`` runs them all).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import numpy as np

from optax_accum._core import _placement
from optax_accum._core._state import StoredNode
from optax_accum._layouts import Layout, register, saved_as, to_sum


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["leaves"], meta_fields=["treedef"]
)
@dataclasses.dataclass(frozen=True)
class Flat(StoredNode):
  """The sums' leaves in tree order, and the tree they come from."""

  leaves: tuple[Any, ...]
  treedef: Any
  contents: ClassVar[str] = "sums stored as a flat tuple (tests/flat_layout.py)"


@register
@dataclasses.dataclass(frozen=True)
class FlatLayout(Layout):
  """Programs take the sums as one sum and return them flat."""

  treedef: Any
  converts: ClassVar[bool] = True

  @classmethod
  def holds(cls, acc: Any) -> bool:
    return isinstance(acc, Flat)

  @classmethod
  def to_sum(cls, acc: Flat) -> Any:
    return jax.tree.unflatten(acc.treedef, acc.leaves)

  @classmethod
  def sum_shapes(cls, acc: Flat) -> Any:
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cls.to_sum(acc)
    )

  @classmethod
  def from_sum(cls, total: Any, target: Flat) -> Flat:
    placed = map(_placement.placed_like, jax.tree.leaves(total), target.leaves)
    return Flat(tuple(placed), target.treedef)

  @classmethod
  def saved_in(cls, saved: Any) -> bool:
    return saved_as(saved, Flat, {"leaves"})

  @classmethod
  def restore_target(cls, shapes: Any, saved: Any, given: Any) -> Flat:
    del saved, given
    zeros = tuple(np.zeros(s.shape, s.dtype) for s in jax.tree.leaves(shapes))
    return Flat(zeros, jax.tree.structure(shapes))

  @classmethod
  def kept(cls, acc: Flat) -> FlatLayout:
    return FlatLayout(acc.treedef)

  def lay_out(self, state: Any, params: Any = None, terms: Any = None) -> Any:
    return state._replace(acc_grads=flat(state.acc_grads))

  def inside(self, acc: Flat) -> Any:
    return jax.tree.unflatten(acc.treedef, acc.leaves)

  def outside(self, acc: Any) -> Flat:
    return Flat(tuple(jax.tree.leaves(acc)), self.treedef)


def flat(acc: Any) -> Flat:
  """``acc`` (any layout) stored flat."""
  if isinstance(acc, Flat):
    return acc
  total = to_sum(acc)
  return Flat(tuple(jax.tree.leaves(total)), jax.tree.structure(total))

"""A layout new to the library, in one file and without editing it: the
window's sums stored as a flat tuple of leaves (``Flat``) between calls.

The layout is one factory, :func:`flat_layout`, of a value of four functions'
fields; its stored node says how it becomes one sum and which layout keeps it.
Every path finds it through them (``tests/test_layout_protocol.py`` runs them
all).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax

from optax_accum._core._state import StoredNode
from optax_accum._layouts import Layout, renamed, to_sum


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["leaves"], meta_fields=["treedef"]
)
@dataclasses.dataclass(frozen=True)
class Flat(StoredNode):
  """The sums' leaves in tree order, and the tree they come from."""

  leaves: tuple[Any, ...]
  treedef: Any
  contents: ClassVar[str] = "sums stored as a flat tuple (tests/flat_layout.py)"

  def to_sum(self) -> Any:
    return jax.tree.unflatten(self.treedef, self.leaves)

  def layout(self) -> Layout:
    return FLAT


def flat_layout() -> Layout:
  """Programs take the sums flat and add to them as one sum."""

  def store(acc: Any, params: Any, terms: Any) -> Flat:
    return flat(acc)

  def wrap(body: Any, window: bool) -> Any:
    def run(inputs: Any) -> Any:
      out = body(inputs._replace(acc=inputs.acc.to_sum()))
      return out._replace(acc=flat(out.acc))

    return renamed(run, body)

  return Layout(None, store, wrap, lambda window: None)


def flat(acc: Any) -> Flat:
  """``acc`` (any stored node) stored flat."""
  if isinstance(acc, Flat):
    return acc
  total = to_sum(acc)
  return Flat(tuple(jax.tree.leaves(total)), jax.tree.structure(total))


FLAT = flat_layout()

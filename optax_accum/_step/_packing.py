"""The packed accumulator: many small sums in a few buffers per dtype.

Every buffer a program takes or returns costs the host time on every call,
whatever its size, and XLA:CPU runs a kernel per leaf for each small add. On a
model of many small leaves (an unscanned transformer's norms and biases, or
hundreds of small layers) the step's accumulator then costs more to pass and to
launch than to add to. In the packed layout the step passes one buffer per
group of small leaves of one dtype instead. Inside the programs
(:class:`PackedBodies`) each micro-batch's gradients are packed alike and
added to a group in one pass; the optimizer gets the sums cut back into
leaves. The arithmetic is the same element by element, so every result is
bit-identical.

``opt_state.acc_grads`` keeps the params' structure, so that a checkpoint
restores with the recipe of ``docs/checkpointing.md``: the first leaf of each
group holds the group's sums, flattened and concatenated in tree order, and
each other leaf of the group a placeholder 0 of shape ``()``, which the host
keeps and never passes to a program.

Examples:
  >>> import jax.numpy as jnp
  >>> acc = {f"b{i}": jnp.full((2,), float(i)) for i in range(3)}
  >>> packing = plan(acc, min_leaves=2)
  >>> packed = pack(acc, packing)
  >>> packed["b0"].tolist(), packed["b1"].shape
  ([0.0, 0.0, 1.0, 1.0, 2.0, 2.0], ())
  >>> unpack(packed, packing)["b2"].tolist()
  [2.0, 2.0]
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._step._programs import Bodies
from optax_accum._step._signature import Inputs, Outputs, Program

#: Leaves of at most this many elements are packed: below it, the host time a
#: buffer costs per call outweighs the extra pass packing makes over its
#: gradients (measured on XLA:CPU; ``docs/benchmarks.md``, many small leaves).
MAX_LEAF_SIZE = 4096
#: A dtype with fewer small leaves is left as it is.
MIN_LEAVES = 16
#: A group holds at most this many elements: its leaves' gradients stay live
#: until they are concatenated, so larger groups need more scratch.
MAX_GROUP_SIZE = 32768


class Packing(NamedTuple):
  """Which accumulator leaves share a buffer, and their shapes (the layout)."""

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]  # Each leaf's own shape, in tree order.
  groups: tuple[tuple[int, ...], ...]  # Leaf indices; the first holds the buffer.
  rest: tuple[int, ...]  # The leaves passed as they are.

  def size(self, group: tuple[int, ...]) -> int:
    return sum(math.prod(self.shapes[i]) for i in group)


def plan(
  acc: Any,
  params: Any = None,
  max_leaf_size: int | None = None,
  min_leaves: int | None = None,
) -> Packing | None:
  """The packing of an accumulator ``acc`` (arrays or shapes, one sum, like
  ``params``), or ``None`` where no dtype has ``min_leaves`` small leaves (by
  default :data:`MIN_LEAVES` leaves of at most :data:`MAX_LEAF_SIZE`
  elements). A group's leaves share their dtype and their params' dtype (the
  gradients', packed alike)."""
  max_leaf_size = MAX_LEAF_SIZE if max_leaf_size is None else max_leaf_size
  min_leaves = MIN_LEAVES if min_leaves is None else min_leaves
  leaves, treedef = jax.tree.flatten(acc)
  likes = leaves if params is None else jax.tree.leaves(params)
  by_dtype: dict[Any, list[int]] = {}
  for i, (leaf, like) in enumerate(zip(leaves, likes, strict=True)):
    if 1 <= math.prod(jnp.shape(leaf)) <= max_leaf_size:
      key = (jnp.dtype(leaf.dtype), jnp.result_type(like))
      by_dtype.setdefault(key, []).append(i)
  shapes = tuple(tuple(jnp.shape(x)) for x in leaves)
  chosen = [g for g in by_dtype.values() if len(g) >= min_leaves]
  groups = tuple(g for c in chosen for g in _split(c, shapes) if len(g) > 1)
  if not groups:
    return None
  packed = {i for group in groups for i in group}
  rest = tuple(i for i in range(len(leaves)) if i not in packed)
  return Packing(treedef, shapes, groups, rest)


def _split(indices: list[int], shapes: Any) -> list[tuple[int, ...]]:
  """``indices`` in consecutive groups of at most :data:`MAX_GROUP_SIZE`
  elements."""
  groups: list[list[int]] = [[]]
  size = 0
  for i in indices:
    n = math.prod(shapes[i])
    if groups[-1] and size + n > MAX_GROUP_SIZE:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += n
  return [tuple(g) for g in groups]


def is_packed(acc: Any, packing: Packing) -> bool:
  """Whether ``acc`` is in ``packing``'s layout (else it is one sum)."""
  leaves = jax.tree.leaves(acc)
  return len(leaves) == len(packing.shapes) and all(
    jnp.shape(leaves[g[0]]) == (packing.size(g),) for g in packing.groups
  )


def pack(acc: Any, packing: Packing) -> Any:
  """``acc`` (one sum) in the packed layout, on the device of its leaves."""
  return _pack(acc, packing)


def unpack(acc: Any, packing: Packing) -> Any:
  """``acc`` (packed) as one sum: every leaf in its own shape."""
  leaves = jax.tree.leaves(acc)
  if _on_host(leaves):
    return _unpacked(packing, *_parts(packing, leaves), np)
  return _unpack(_parts(packing, leaves), packing)


# One program each, not one dispatch a leaf: a state the step did not return
# last (a restored checkpoint, another loop's) is packed or unpacked at once.
@functools.partial(jax.jit, static_argnums=1)
def _pack(acc: Any, packing: Packing) -> Any:
  placeholders = [jnp.zeros((), x.dtype) for x in jax.tree.leaves(acc)]
  out = _refilled(packing, placeholders, *_packed(acc, packing))
  return jax.tree.unflatten(packing.treedef, out)


@functools.partial(jax.jit, static_argnums=1)
def _unpack(parts: tuple[Any, list[Any]], packing: Packing) -> Any:
  return _unpacked(packing, *parts)


def _parts(packing: Packing, leaves: list[Any]) -> tuple[tuple[Any, ...], list[Any]]:
  """A packed accumulator's leaves as (group buffers, other leaves)."""
  groups = tuple(leaves[g[0]] for g in packing.groups)
  return groups, [leaves[i] for i in packing.rest]


def _refilled(packing: Packing, leaves: list[Any], groups: Any, rest: Any) -> list[Any]:
  """``leaves`` (a packed accumulator's) with the group buffers and other
  leaves put in their places; the placeholders stay where they are."""
  for group, buffer in zip(packing.groups, groups, strict=True):
    leaves[group[0]] = buffer
  for i, leaf in zip(packing.rest, rest, strict=True):
    leaves[i] = leaf
  return leaves


def _on_host(leaves: list[Any]) -> bool:
  return all(isinstance(x, np.ndarray | np.generic) for x in leaves)


def _unpacked(packing: Packing, groups: Any, rest: Any, xp: Any = jnp) -> Any:
  out: list[Any] = [None] * len(packing.shapes)
  for i, leaf in zip(packing.rest, rest, strict=True):
    out[i] = leaf
  for group, buffer in zip(packing.groups, groups, strict=True):
    start = 0
    for i in group:
      stop = start + math.prod(packing.shapes[i])
      out[i] = xp.reshape(buffer[start:stop], packing.shapes[i])
      start = stop
  return jax.tree.unflatten(packing.treedef, out)


def _packed(acc: Any, packing: Packing) -> tuple[tuple[Any, ...], list[Any]]:
  """Inside a program: one sum's leaves as (group buffers, other leaves)."""
  leaves = jax.tree.leaves(acc)
  groups = tuple(
    jnp.concatenate([jnp.ravel(leaves[i]) for i in group]) for group in packing.groups
  )
  return groups, [leaves[i] for i in packing.rest]


class Recent:
  """The accumulator tree a packed program returned last, and its leaves, so
  that the next call finds them without walking the tree: the step's Python
  stays O(1) per call once warm (one C++ ``unflatten`` builds the returned
  tree, as ``jit`` builds its own outputs)."""

  def __init__(self, packing: Packing):
    self.packing = packing
    self.tree: Any = None
    self.leaves: list[Any] = []

  def leaves_of(self, tree: Any) -> list[Any]:
    return list(self.leaves if tree is self.tree else jax.tree.leaves(tree))

  def tree_of(self, leaves: list[Any]) -> Any:
    self.tree = jax.tree.unflatten(self.packing.treedef, leaves)
    self.leaves = leaves
    return self.tree


class PackedBodies(Bodies):
  """The train step's bodies with the accumulator packed inside the program.

  Each micro-batch's gradient is packed as the sums are (one concatenation
  per group) and added to them in one pass over each buffer, as to a
  contiguous accumulator; the optimizer gets the sums cut back into leaves.
  The arithmetic is the same, element by element.
  """

  def __init__(self, bodies: Bodies, packing: Packing):
    super().__init__(bodies.loss_fn, bodies.optimizer, bodies.has_aux, bodies.reduction)
    self.packing = packing

  def accumulated(self, grads: Any) -> Any:
    return _packed(grads, self.packing)

  def as_params(self, acc: Any) -> Any:
    return _unpacked(self.packing, *acc)


class PackedProgram:
  """A :class:`Program` of :class:`PackedBodies`' bodies, called with the
  accumulator in the state's packed layout: the host passes only the group
  buffers and the unpacked leaves, and puts the results back in the
  placeholders' tree."""

  def __init__(self, recent: Recent, program: Program):
    self.recent, self.program = recent, program
    self.packing = recent.packing

  def _split(self, inputs: Inputs) -> tuple[Inputs, list[Any]]:
    leaves = self.recent.leaves_of(inputs.acc)
    return inputs._replace(acc=_parts(self.packing, leaves)), leaves

  def __call__(self, inputs: Inputs) -> Outputs:
    inputs, leaves = self._split(inputs)
    out = self.program(inputs)
    placed = _refilled(self.packing, leaves, *out.acc)
    return out._replace(acc=self.recent.tree_of(placed))

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.program.lower(self._split(inputs)[0])


class PackedUpdate:
  """The update program on a packed accumulator, run as two: ``accumulate``
  adds the micro-batch, ``ending`` ends the window (faster than one program
  on XLA:CPU where dispatch weighs as much as the work; ``docs/benchmarks.md``).
  ``merged`` (the update body as one program) is what :meth:`lower` gives for
  XLA's analyses: its peak memory bounds each of the two's.
  """

  def __init__(
    self, accumulate: PackedProgram, ending: PackedProgram, merged: PackedProgram
  ):
    self.accumulate, self.ending, self.merged = accumulate, ending, merged

  def __call__(self, inputs: Inputs) -> Outputs:
    added = self.accumulate(inputs._replace(inner=None, end_window=None))
    ends = inputs._replace(acc=added.acc, counters=added.counters, batch=None)
    return self.ending(ends._replace(rng=None))._replace(aux=added.aux)

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.merged.lower(inputs)

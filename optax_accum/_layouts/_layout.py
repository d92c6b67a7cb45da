"""A layout: how a train step's programs hold the window's sums, as a small
value of functions (:class:`Layout`), one factory each: :func:`one_sum`,
:func:`per_replica`, :func:`deferred`. How the sums are stored between calls
is ``_storage``'s.

Examples:
  >>> ONE_SUM.reduction is None and ONE_SUM.sharded(False) is None
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from optax_accum._core import _reduction
from optax_accum._core._window import Names
from optax_accum._layouts._storage import (
  per_replica_like,
  replica_spec,
  stored_as,
  sum_shapes,
  to_sum,
)

#: A program body: ``Inputs`` to ``Outputs`` (``_step._programs``).
Body = Callable[[Any], Any]


class Sharded(NamedTuple):
  """A program's ``shard_map``: its mesh and axes, and the specs of what is
  split over them (the accumulator, the rows of a batch, ``aux``)."""

  mesh: Mesh
  axes: tuple[str, ...]
  acc: Any
  rows: Any
  aux: Any


class Layout(NamedTuple):
  """How programs hold the window's sums (as optax's microbatching
  ``Accumulator``, a value of a few functions).

  Attributes:
    reduction: The bodies' reduction policy (``_core._reduction``), or ``None``
      for the step's own.
    store: ``store(acc, params, terms)``: ``acc`` (any stored node) stored as
      these programs take it between calls.
    wrap: ``wrap(body, window)``: ``body`` on the accumulator as the programs
      take it (``window``: a body of a whole window, ``aux`` stacked).
    sharded: ``sharded(window)``: the ``shard_map`` the programs run in, or ``None``.
  """

  reduction: Any
  store: Callable[[Any, Any, Names], Any]
  wrap: Callable[[Body, bool], Body]
  sharded: Callable[[bool], Sharded | None]


def one_sum() -> Layout:
  """Sums laid out as the params, the step's own reduction, no ``shard_map``."""
  return Layout(None, lambda acc, params, terms: to_sum(acc), _same, _unsharded)


def _same(body: Body, window: bool) -> Body:
  return body


def _unsharded(window: bool) -> None:
  return None


ONE_SUM = one_sum()


@functools.cache
def per_replica(mesh: Mesh, axes: tuple[str, ...]) -> Layout:
  """Partial sums over ``axes``, added in a ``shard_map``, reduced once a window;
  stored as :class:`~optax_accum.PerReplica`."""

  def store(acc: Any, params: Any, terms: Names) -> Any:
    return stored_as(acc, per_replica_like(mesh, axes, sum_shapes(acc), params, terms))

  def wrap(body: Body, window: bool) -> Body:
    """``body`` on this replica's slice of the accumulator's replica axis;
    ``aux`` gains a replica axis (after the micro-batch axis of a window)."""

    def run(inputs: Any) -> Any:
      out = body(inputs._replace(acc=jax.tree.map(lambda a: a[0], inputs.acc)))
      return out._replace(acc=_stack(out.acc), aux=_stack(out.aux, int(window)))

    return renamed(run, body)

  def sharded(window: bool) -> Sharded:
    rows = P(None, *replica_spec(axes)) if window else replica_spec(axes)
    return Sharded(mesh, axes, replica_spec(axes), rows, rows)

  return Layout(_reduction.policy(axes, at_window_end=True), store, wrap, sharded)


@functools.cache
def deferred(mesh: Mesh, axes: tuple[str, ...], leaves: tuple[bool, ...]) -> Layout:
  """Per-device partial sums over ``Explicit`` axes ``axes``, added in the
  global view: params cast to ``reduced`` keep each ``leaves`` leaf's gradient
  ``unreduced``, reduced once a window (``_reduction.Deferred``); stored as
  :class:`~optax_accum.PerReplica` (same checkpoints). JAX 0.10 refuses some
  ops on a ``reduced`` operand (a bias added to data-split activations): such
  leaves, found by tracing (:func:`choose_leaves`), reduce per micro-batch."""

  def wrap(body: Body, window: bool) -> Body:
    def run(inputs: Any) -> Any:
      out = body(inputs._replace(acc=_relaid(mesh, axes, inputs.acc, inside=True)))
      return out._replace(acc=_relaid(mesh, axes, out.acc, inside=False))

    return renamed(run, body)

  reduction = _reduction.Deferred(mesh=mesh, over=axes, leaves=leaves)
  return Layout(reduction, per_replica(mesh, axes).store, wrap, _unsharded)


def choose_leaves(
  mesh: Mesh, axes: tuple[str, ...], fits: Callable[[Layout], bool], params: Any
) -> Layout:
  """The deferred layout of the largest set of 2+-D leaves ``fits`` accepts;
  the others' gradients, reduced by XLA, join the first replica's partial sum."""
  flat = jax.tree.leaves(params)
  wanted = [i for i, p in enumerate(flat) if jnp.ndim(p) >= 2]

  def with_leaves(chosen: Sequence[int]) -> Layout:
    return deferred(mesh, axes, tuple(i in chosen for i in range(len(flat))))

  return with_leaves(_fitting(wanted, lambda c: fits(with_leaves(c))))


def _fitting(indices: list[int], fits: Callable[[list[int]], bool]) -> list[int]:
  """The indices ``fits`` accepts together, by halving (few traces per failure)."""
  if not indices or fits(indices):
    return indices
  if len(indices) == 1:
    return []
  half = len(indices) // 2
  left, right = _fitting(indices[:half], fits), _fitting(indices[half:], fits)
  if left and right and not fits(left + right):
    return max(left, right, key=len)
  return left + right


def _relaid(mesh: Mesh, axes: tuple[str, ...], acc: Any, inside: bool) -> Any:
  """The accumulator as programs add to it (``inside``: ``unreduced`` partial
  sums) or as stored (stacked on a replica axis). No data moves: an unchecked
  ``shard_map`` (``unreduced`` to per-device values has no typed cast)."""

  def relaid(x: jax.Array) -> jax.Array:
    rest = jax.typeof(x).sharding.spec.partitions[1 if inside else 0 :]
    stored, added = replica_spec(axes, *rest), P(*rest, unreduced=set(axes))
    in_spec, out_spec = (stored, added) if inside else (added, stored)
    fn = (lambda s: s[0]) if inside else (lambda v: v[None])
    return jax.shard_map(
      fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False
    )(x)

  return jax.tree.map(relaid, acc)


def renamed(wrapper: Body, body: Body) -> Body:
  """``wrapper`` named as ``body``, whose program it builds (what jit logs)."""
  wrapper.__name__ = wrapper.__qualname__ = getattr(body, "__name__", "program")
  return wrapper


def _stack(tree: Any, axis: int = 0) -> Any:
  """``tree`` with a replica axis at ``axis``."""
  return jax.tree.map(lambda a: jnp.expand_dims(a, axis), tree)

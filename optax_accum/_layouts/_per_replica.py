"""Per-replica partial sums: one gradient reduction per window under plain jit.

With ``axis_name`` under plain ``jit`` on a batch split over it, the programs run
in a ``shard_map``: each replica adds its rows' gradient to its own partial sum,
reduced once when the window ends. Between calls a :class:`PerReplica` holds the
sums on a leading replica axis split over the data axes: one params-sized sum a
device.

Examples:
  >>> import jax.numpy as jnp
  >>> acc = PerReplica({"w": jnp.ones((2, 3))}, ("data",))
  >>> PerReplicaLayout.to_sum(acc)["w"].tolist()
  [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum._core import _checks, _placement, _reduction, _window
from optax_accum._core._state import MultiStepsState, StoredNode
from optax_accum._core._window import Names
from optax_accum._layouts._protocol import (
  Body,
  Layout,
  Sharded,
  field,
  leaves,
  register,
  renamed,
  saved_as,
  sum_shapes,
  to_sum,
)


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["sums"], meta_fields=["axes"]
)
@dataclasses.dataclass(frozen=True)
class PerReplica(StoredNode):
  """Per-replica partial sums: ``sums`` laid out as one sum, each leaf with
  a leading axis of replicas, split over the mesh axes ``axes``."""

  sums: Any
  axes: tuple[str, ...]
  contents: ClassVar[str] = (
    "per-replica partial sums (a train step's state on a mesh, from step.init)"
  )


@register
@dataclasses.dataclass(frozen=True)
class PerReplicaLayout(Layout):
  """Partial sums over ``axes``, added in a ``shard_map``; stored as ``PerReplica``."""

  mesh: jax.sharding.Mesh
  axes: tuple[str, ...]
  converts: ClassVar[bool] = True

  # -- the stored node ----------------------------------------------------------

  @classmethod
  def holds(cls, acc: Any) -> bool:
    return isinstance(acc, PerReplica)

  @classmethod
  def to_sum(cls, acc: PerReplica) -> Any:
    return jax.tree.map(lambda a: jnp.sum(a, axis=0, dtype=a.dtype), acc.sums)

  @classmethod
  def sum_shapes(cls, acc: PerReplica) -> Any:
    return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), acc.sums
    )

  @classmethod
  def from_sum(cls, total: Any, target: PerReplica) -> PerReplica:
    """``total`` as the first replica's partial sum (the others zeros): exact,
    so a window in progress carries on."""
    n = replicas(target)
    sums = jax.tree.map(lambda t, a: _first_placed(t, n, a), total, target.sums)
    return PerReplica(sums, target.axes)

  @classmethod
  def convert(cls, acc: Any, target: PerReplica) -> PerReplica:
    """As many replicas' partial sums keep their places; others are added up."""
    if cls.holds(acc) and replicas(acc) == replicas(target):
      sums = jax.tree.map(_placement.placed_like, acc.sums, target.sums)
      return PerReplica(sums, target.axes)
    return cls.from_sum(to_sum(acc), target)

  @classmethod
  def saved_in(cls, saved: Any) -> bool:
    return saved_as(saved, PerReplica, {"sums"}, optional=frozenset({"axes"}))

  @classmethod
  def restore_target(cls, shapes: Any, saved: Any, given: Any) -> PerReplica:
    n = int(np.shape(leaves(field(saved, "sums"))[0])[0])
    stacked = jax.tree.map(lambda s: np.zeros((n, *s.shape), s.dtype), shapes)
    axes = given.axes if cls.holds(given) else field(saved, "axes", ())
    return PerReplica(stacked, tuple(axes))

  @classmethod
  def kept(cls, acc: PerReplica) -> Layout | None:
    """``None``: the partial sums of the call's devices (added up on others)."""
    del acc
    return None

  @classmethod
  def carried(cls, total: Any, given: PerReplica) -> PerReplica:
    """Traced: ``total`` as replica 0's partial sum, stacked as ``given``."""
    n = replicas(given)

    def stack(t: Any, like: Any) -> Any:
      out = first_replica(t, n)
      sharding = getattr(jax.typeof(like), "sharding", None)
      if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        out = jax.sharding.reshard(out, sharding)
      return out

    return PerReplica(jax.tree.map(stack, total, given.sums), given.axes)

  # -- in a train step's programs -----------------------------------------------

  @property
  def replicas(self) -> int:
    return math.prod(self.mesh.shape[axis] for axis in self.axes)

  def spec(self, *rest: Any) -> P:
    """A spec whose leading dimension is split over the data axes."""
    return P(self.axes[0] if len(self.axes) == 1 else self.axes, *rest)

  def lay_out(
    self, state: MultiStepsState, params: Any = None, terms: Names = None
  ) -> MultiStepsState:
    acc = state.acc_grads
    sums = sum_shapes(acc)
    _check_params(params, sums, terms)
    target = self.like(sums, params, terms)
    return state._replace(acc_grads=type(self).convert(acc, target))

  def like(self, sums: Any, params: Any, terms: Names = None) -> PerReplica:
    """Shapes of ``sums`` (one per term) as stored: a leading replica axis split
    over the data axes, each partial sum split like its param on other axes."""

    def stacked(a: Any, p: Any) -> jax.ShapeDtypeStruct:
      rest = _placement.spec_on(self.mesh, p) or (None,) * jnp.ndim(p)
      sharding = NamedSharding(self.mesh, self.spec(*rest))
      return jax.ShapeDtypeStruct((self.replicas, *a.shape), a.dtype, sharding=sharding)

    trees = _window.per_term(sums, terms)
    stacks = tuple(jax.tree.map(stacked, tree, params) for tree in trees)
    return PerReplica(_window.stored(stacks, terms), self.axes)

  def policy(self) -> Any:
    return _reduction.policy(self.axes, at_window_end=True)

  def body(self, body: Body, window: bool) -> Body:
    """``body`` on this replica's slice of the accumulator's replica axis;
    ``aux`` gains a replica axis (after the micro-batch axis of a window)."""

    def run(inputs: Any) -> Any:
      out = body(inputs._replace(acc=jax.tree.map(lambda a: a[0], inputs.acc)))
      return out._replace(acc=_stack(out.acc), aux=_stack(out.aux, int(window)))

    return renamed(run, body)

  def sharded(self, window: bool) -> Sharded | None:
    """The accumulator, rows and ``aux`` split over ``axes``."""
    rows = P(None, *self.spec()) if window else self.spec()
    return Sharded(self.mesh, self.axes, self.spec(), rows, rows)

  def inside(self, acc: PerReplica) -> Any:
    return acc.sums

  def outside(self, acc: Any) -> PerReplica:
    return PerReplica(acc, self.axes)


def _check_params(params: Any, sums: Any, terms: Names) -> None:
  """Raises ``ValueError`` naming the first leaf of ``params`` that a state's
  sums (one tree per term, any layout) lack or hold in another shape."""
  for tree in _window.per_term(sums, terms):
    _checks.check_tree_matches(
      params,
      tree,
      name="params",
      ref_name="the state's accumulator (step.init of the params it was made "
      "for; a state of other params starts from step.init(params))",
    )


def replicas(acc: PerReplica) -> int:
  """The number of replicas ``acc`` holds partial sums for."""
  return int(np.shape(jax.tree.leaves(acc.sums)[0])[0])


def first_replica(total: jax.Array, n: int) -> jax.Array:
  """``total`` as the first of ``n`` replicas' partial sums (zeros for the
  others): a select, so that a sharded sum moves nothing."""
  first = (jnp.arange(n) == 0).reshape((n,) + (1,) * jnp.ndim(total))
  return jnp.where(first, total[None], jnp.zeros((), total.dtype))


def _first_placed(total: Any, n: int, like: Any) -> Any:
  """``total`` as the first of ``n`` partial sums, placed as ``like``."""
  sharding = getattr(like, "sharding", None)
  total = jnp.asarray(total, like.dtype)
  if isinstance(sharding, NamedSharding):
    inner = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    return _first_replica(sharding)(_placement.put(total, inner), n)
  out = first_replica(total, n)
  return jax.device_put(out, sharding) if sharding is not None else out


@functools.cache
def _first_replica(sharding: NamedSharding) -> Any:
  """:func:`first_replica` as a program whose result is placed as
  ``sharding``: each device computes its own slice, nothing moves."""
  return jax.jit(first_replica, static_argnums=1, out_shardings=sharding)


def _stack(tree: Any, axis: int = 0) -> Any:
  """``tree`` with a replica axis at ``axis``."""
  return jax.tree.map(lambda a: jnp.expand_dims(a, axis), tree)

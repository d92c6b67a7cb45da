"""How the window's sums are stored between calls: plain functions, each one
``match`` over the stored nodes.

``opt_state.acc_grads`` is one sum laid out as the params, a
:class:`PerReplica` (each replica's partial sum on a leading axis), a
:class:`~optax_accum.Packed` (restored only), or a node new to the library (a
``StoredNode`` with ``to_sum`` and ``layout``). A node is recognised by its
type, and a checkpoint by its tree matching the params' first, so params
with a key named like a node's field are never taken for one.

Examples:
  >>> import jax.numpy as jnp
  >>> to_sum(PerReplica({"w": jnp.ones((2, 3))}, ("data",)))["w"].tolist()
  [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum._core import _checks, _placement, _window
from optax_accum._core._state import MultiStepsState, StoredNode
from optax_accum._layouts import _packed

#: What the params must match in :func:`per_replica_like`, as a mismatch's error
#: names it.
_SUMS_NAME = (
  "the state's accumulator (step.init of the params it was made for; a state "
  "of other params starts from step.init(params))"
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerReplica(StoredNode):
  """Per-replica partial sums: ``sums`` laid out as one sum, each leaf with
  a leading axis of replicas, split over the mesh axes ``axes``."""

  sums: Any
  axes: tuple[str, ...] = dataclasses.field(metadata={"static": True})
  contents: ClassVar[str] = (
    "per-replica partial sums (a train step's state on a mesh, from step.init)"
  )


def to_sum(acc: Any) -> Any:
  """``acc`` as one sum laid out as the params (exact but for partial sums' add)."""
  match acc:
    case PerReplica():
      return jax.tree.map(lambda a: jnp.sum(a, axis=0, dtype=a.dtype), acc.sums)
    case _packed.Packed():
      return _packed.unpacked(acc)
    case StoredNode():
      return acc.to_sum()  # type: ignore[attr-defined]  # A node new to the library.
    case _:
      return acc


def sum_shapes(acc: Any) -> Any:
  """Shapes and dtypes of ``acc`` (any node) as one sum."""
  match acc:
    case PerReplica():
      return jax.tree.map(lambda a: _shape(a, np.shape(a)[1:]), acc.sums)
    case StoredNode():
      return jax.eval_shape(to_sum, acc)
    case _:
      return jax.tree.map(_shape, acc)


def stored_as(acc: Any, like: Any) -> Any:
  """``acc`` (any node) stored as ``like`` (a node or its shapes), placed like it.
  A sum becoming the first replica's partial sum is exact, and as many
  replicas' partial sums keep their places; others are added up first."""
  match like:
    case PerReplica():
      if isinstance(acc, PerReplica) and replicas(acc) == replicas(like):
        sums = jax.tree.map(_placement.placed_like, acc.sums, like.sums)
      else:
        n = replicas(like)
        sums = jax.tree.map(lambda t, a: _first_placed(t, n, a), to_sum(acc), like.sums)
      return PerReplica(sums, like.axes)
    case _packed.Packed():
      raise ValueError("Packed sums are only restored: relayout them to one sum.")
    case StoredNode():
      return like.layout().store(acc, None, None)  # type: ignore[attr-defined]
    case _:
      return jax.tree.map(_placement.placed_like, to_sum(acc), like)


def per_replica_like(
  mesh: Mesh, axes: tuple[str, ...], sums: Any, params: Any, terms: _window.Names
) -> PerReplica:
  """Shapes of one sum's ``sums`` (one tree per term) stored per replica over
  ``axes``: a leading replica axis split over them, each partial sum split
  like its param on other axes."""
  n = replica_count(mesh, axes)

  def stacked(a: Any, p: Any) -> jax.ShapeDtypeStruct:
    rest = _placement.spec_on(mesh, p) or (None,) * jnp.ndim(p)
    sharding = NamedSharding(mesh, replica_spec(axes, *rest))
    return jax.ShapeDtypeStruct((n, *a.shape), a.dtype, sharding=sharding)

  trees = _window.per_term(sums, terms)
  for tree in trees:
    _checks.check_tree_matches(params, tree, name="params", ref_name=_SUMS_NAME)
  stacks = tuple(jax.tree.map(stacked, tree, params) for tree in trees)
  return PerReplica(_window.stored(stacks, terms), axes)


def replica_count(mesh: Mesh, axes: tuple[str, ...]) -> int:
  """The number of replicas over the mesh axes ``axes``."""
  return math.prod(mesh.shape[a] for a in axes)


def replica_spec(axes: tuple[str, ...], *rest: Any) -> P:
  """A spec whose leading dimension is split over the data axes ``axes``."""
  return P(axes[0] if len(axes) == 1 else axes, *rest)


def inside(acc: Any) -> Any:
  """The stored ``acc`` as programs take it: partial sums without their node."""
  return acc.sums if isinstance(acc, PerReplica) else acc


def outside(acc: Any, like: Any) -> Any:
  """A program's ``acc`` stored as ``like`` is (:func:`inside`'s inverse)."""
  return PerReplica(acc, like.axes) if isinstance(like, PerReplica) else acc


def carried(state: MultiStepsState, given: Any) -> MultiStepsState:
  """A traced call's one-sum ``state`` with its sums stored as ``given`` where a
  carry must keep its type (the user's ``lax.scan``): replica 0's partial sum."""
  if not isinstance(given, PerReplica) or isinstance(state.acc_grads, PerReplica):
    return state
  n = replicas(given)

  def stack(t: Any, like: Any) -> Any:
    sharding = getattr(jax.typeof(like), "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
      return jax.sharding.reshard(first_replica(t, n), sharding)
    return first_replica(t, n)

  sums = jax.tree.map(stack, state.acc_grads, given.sums)
  return state._replace(acc_grads=PerReplica(sums, given.axes))


def relayout(state: MultiStepsState, like: MultiStepsState) -> MultiStepsState:
  """``state`` with its accumulator in the layout of ``like``'s.

  ``like`` is a state of the same params from ``opt.init(params)`` or, for a
  train step on a mesh, ``step.init(params)``. A sum becoming the first
  replica's partial sum is exact, and so is unpacking a checkpoint's packed
  sums (:class:`~optax_accum.Packed`, written before packing was removed);
  partial sums for another layout are added up first (a rounding per add).
  Arrays take the placement of ``like``'s.

  Raises:
    ValueError: if the two accumulators are not of the same params.

  Examples:
    A checkpoint's packed sums (20 leaves in one buffer), restored against
    :func:`~optax_accum.resume_target`'s target, as one sum:

    >>> import numpy as np, optax, optax_accum
    >>> params = {f"b{i:02d}": np.zeros(2, np.float32) for i in range(20)}
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> saved = {"acc_grads": {"groups": [np.arange(40, dtype=np.float32)], "rest": ()}}
    >>> restored = optax_accum.resume_target(opt.init(params), saved)
    >>> type(restored.acc_grads).__name__
    'Packed'
    >>> restored = restored._replace(acc_grads=optax_accum.Packed(
    ...   (np.arange(40, dtype=np.float32),), (), restored.acc_grads.packing))
    >>> one = optax_accum.relayout(restored, opt.init(params))
    >>> type(one.acc_grads).__name__, one.acc_grads["b03"].tolist()
    ('dict', [6.0, 7.0])
  """
  acc = state.acc_grads
  target = None if like is None else like.acc_grads
  if _structure(acc) == _structure(target):
    return state
  # Outside a trace, no context mesh (under the user's jax.set_mesh, arrays
  # committed to other devices cannot meet): their own shardings place the work.
  traced = _placement.traced(state, like)
  with contextlib.nullcontext() if traced else jax.set_mesh(None):
    if target is None:
      return state._replace(acc_grads=to_sum(acc))
    _checks.check_tree_matches(
      sum_shapes(acc),
      sum_shapes(target),
      name="state's accumulator",
      ref_name="`like`'s (relayout converts states of the same params; start a "
      "state for other params from opt.init(params))",
    )
    return state._replace(acc_grads=stored_as(acc, target))


def _structure(tree: Any) -> Any:
  """``tree``'s structure and its leaves' shapes: the same for two accumulators
  in one layout, shapes included."""
  return jax.tree.structure(tree), [np.shape(x) for x in jax.tree.leaves(tree)]


def resume_target(state: MultiStepsState, saved: Any) -> MultiStepsState:
  """``state`` as the target to restore a checkpoint of ``saved``'s layout.

  A checkpoint's layout (per-replica sums of shape ``(8, ...)`` for 8
  replicas) may fit no target from ``step.init(params)`` on the devices you
  resume on: this builds one.

  Args:
    state: The state you would start from where you resume (``step.init(params)``
      or ``opt.init(params)`` on the devices you resume on; for sums stored
      in a node new to the library, a state holding such a node).
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

  Examples:
    A state saved with 8 replicas' partial sums, resumed on one device:

    >>> import numpy as np, optax, optax_accum
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
    >>> here = opt.init({"w": np.zeros(3, np.float32)})
    >>> saved = {"acc_grads": {"sums": {"w": np.zeros((8, 3), np.float32)}}}
    >>> resume_target(here, saved).acc_grads.sums["w"].shape
    (8, 3)
  """
  held = field(saved, "held", None)
  if held is not None:  # A streamed coupled window's micro-batches.
    state = state._replace(held=tuple(jax.tree.map(zeros, [*held], is_leaf=is_array)))
  return state._replace(acc_grads=_target(field(saved, "acc_grads"), state.acc_grads))


def _target(saved: Any, given: Any) -> Any:
  """Host zeros in ``saved``'s node and shapes: the params' own tree first (one
  sum, whatever its keys), then ``given``'s node, then a node by its fields."""
  shapes = sum_shapes(given)
  if _paths(saved) == _paths(shapes):
    return jax.tree.map(zeros, shapes)
  if isinstance(given, StoredNode) and _paths(saved) == _paths(given):
    return jax.tree.map(zeros, given)
  if _fields_of(saved, PerReplica, {"sums"}, {"axes"}):
    n = replicas(saved)
    stacked = jax.tree.map(lambda s: np.zeros((n, *s.shape), s.dtype), shapes)
    axes = given.axes if isinstance(given, PerReplica) else field(saved, "axes", ())
    return PerReplica(stacked, tuple(axes))
  if _fields_of(saved, _packed.Packed, {"groups", "rest"}, set()):
    groups = jax.tree.leaves(field(saved, "groups"), is_leaf=is_array)
    return _packed.restore_target(shapes, [int(np.prod(np.shape(g))) for g in groups])
  return jax.tree.map(zeros, shapes)


def _paths(tree: Any) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
  """``tree``'s leaves as key names and shapes, sorted: the same for a node and
  orbax's metadata of it (a dict for a ``NamedTuple`` or a dataclass)."""

  def name(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))

  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_array)[0]
  return sorted((tuple(map(name, path)), np.shape(x)) for path, x in flat)


def _fields_of(saved: Any, node: type, fields: set[str], optional: set[str]) -> bool:
  """Whether a checkpoint's ``acc_grads`` is a ``node``: the node itself, or
  orbax's metadata of one (a dict of its data ``fields``, and of ``optional``
  ones, nothing else)."""
  if isinstance(saved, Mapping):
    return fields <= set(saved) <= fields | optional
  return isinstance(saved, node)


def field(tree: Any, name: str, *default: Any) -> Any:
  """A field of a state, a stored node or a checkpoint's metadata (a dict)."""
  if isinstance(tree, Mapping):
    return tree[name] if name in tree or not default else default[0]
  return getattr(tree, name, *default)


def is_array(x: Any) -> bool:
  """Whether ``x`` is an array, or orbax's metadata of one (a shape and a dtype)."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


def zeros(shape: Any) -> np.ndarray:
  """Host zeros of ``shape``'s shape and dtype."""
  return np.zeros(np.shape(shape), shape.dtype)


def replicas(acc: Any) -> int:
  """The number of replicas ``acc`` (a :class:`PerReplica` or orbax's metadata of
  one) holds partial sums for."""
  return int(np.shape(jax.tree.leaves(field(acc, "sums"), is_leaf=is_array)[0])[0])


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
    return _first_replica(sharding)(_placement.placed_like(total, unstacked(like)), n)
  out = first_replica(total, n)
  return jax.device_put(out, sharding) if sharding is not None else out


@functools.cache
def _first_replica(sharding: NamedSharding) -> Any:
  """:func:`first_replica` as a program whose result is placed as
  ``sharding``: each device computes its own slice, nothing moves."""
  return jax.jit(first_replica, static_argnums=1, out_shardings=sharding)


def unstacked(x: Any) -> jax.ShapeDtypeStruct:
  """``x``'s shape and dtype without its leading axis, split as on its others."""
  sharding = NamedSharding(x.sharding.mesh, P(*x.sharding.spec[1:]))
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)


def _shape(x: Any, shape: Any = None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x) if shape is None else shape, x.dtype)

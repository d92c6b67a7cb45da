"""The accumulator's layout: a rule of the params, kept in the state's structure.

``opt_state.acc_grads`` holds the window's sums as one sum (laid out as the
params) or :class:`PerReplica`, and its pytree structure says which (never a
shape); :func:`relayout` converts a state to another's layout. :class:`Packed`
is only restored, from a checkpoint written before packing was removed: the
step's first call and :func:`relayout` turn it into one sum.

Examples:
  >>> import jax.numpy as jnp
  >>> acc = PerReplica({"w": jnp.ones((2, 3))}, ("data",))
  >>> one_sum(acc)["w"].tolist()
  [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from optax_accum._core import _backend, _checks, _window
from optax_accum._core._state import MultiStepsState


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["sums"], meta_fields=["axes"]
)
@dataclasses.dataclass(frozen=True)
class PerReplica:
  """Per-replica partial sums: ``sums`` laid out as one sum, each leaf with
  a leading axis of replicas, split over the mesh axes ``axes``."""

  sums: Any
  axes: tuple[str, ...]


def _split(indices: list[int], shapes: Any, max_size: int) -> list[tuple[int, ...]]:
  """``indices`` in consecutive groups of at most ``max_size`` elements."""
  groups: list[list[int]] = [[]]
  size = 0
  for i in indices:
    n = math.prod(shapes[i])
    if groups[-1] and size + n > max_size:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += n
  return [tuple(g) for g in groups]


def norm_groups(like: Any) -> _window.Groups:
  """Leaves of ``like`` (the params or the updates) whose squares the window's
  norm sums in one variadic reduction: small leaves of one shape and dtype, in
  groups of at most the backend's ``max_group_size`` elements, where the
  backend says so, on one device and outside a mesh context.

  XLA:CPU compiles a kernel per distinct reduction. A variadic reduction's
  sums differ from single ones in their last bits, so the groups depend on
  ``like`` and the backend alone, not on the state's layout: ``grad_norm`` is
  the same to the bit in every layout.

  Examples:
    On the CPU:

    >>> import jax.numpy as jnp
    >>> like = {"a": jnp.ones(3), "b": jnp.ones((2, 2)), "c": jnp.ones(3)}
    >>> norm_groups(jax.device_put(like, jax.devices("cpu")[0]))
    ((0, 2),)
  """
  backend = _backend.of(_backend.platform_of(like))
  if not backend.groups_norm or devices(like) > 1:
    return ()
  if not jax.sharding.get_abstract_mesh().empty:
    return ()
  leaves = jax.tree.leaves(like)
  shapes = [tuple(np.shape(x)) for x in leaves]
  alike: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    if 1 <= math.prod(shapes[i]) <= backend.max_leaf_size:
      alike.setdefault((shapes[i], jnp.result_type(x)), []).append(i)
  size = backend.max_group_size
  groups = (g for same in alike.values() for g in _split(same, shapes, size))
  return tuple(g for g in groups if len(g) > 1)


def devices(tree: Any) -> int:
  """How many devices ``tree`` spans, by its arrays, its shapes' shardings and
  its tracers' ``Explicit`` meshes."""
  found: set[Any] = set()
  most = 1
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.core.Tracer):
      mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
      most = max(most, getattr(mesh, "size", 1) or 1)
    elif isinstance(x, jax.Array):
      found.update(x.devices())
    elif isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
      most = max(most, len(x.sharding.device_set))
  return max(most, len(found))


def committed(tree: Any, inputs: Any) -> Any:
  """``tree``'s arrays committed to the one device of ``inputs``' first committed
  array (``jax.device_put(params, device)``), as a jitted step returns them:
  else the step compiles again for what its first call returns. No copies."""
  arrays = (x for x in jax.tree.leaves(inputs) if _concrete(x))
  first = next((x for x in arrays if x.committed), None)
  if first is None or len(first.devices()) != 1:
    return tree

  def commit(x: Any) -> Any:
    return jax.device_put(x, first.sharding) if _concrete(x) and not x.committed else x

  return jax.tree.map(commit, tree)


def _concrete(x: Any) -> bool:
  return isinstance(x, jax.Array) and not _traced(x)


# -- a checkpoint's packed sums, written before packing was removed ------------


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
class Packed:
  """Packed sums, as checkpoints written before packing was removed hold them:
  ``groups`` (one flat buffer per group, its leaves concatenated in tree order)
  and ``rest`` (the other leaves, in tree order). Only restored
  (:func:`~optax_accum.resume_target`), then made one sum (:func:`unpack`)."""

  groups: tuple[Any, ...]
  rest: tuple[Any, ...]
  packing: Packing


def packing_of(shapes: Any) -> Packing | None:
  """How ``step.init`` packed the sums ``shapes`` (one sum) on one CPU device
  before packing was removed, or ``None`` if it did not: leaves of 1 to 4096
  elements, by dtype where a dtype had at least 16, in consecutive groups of
  at most 8192 elements."""
  leaves, treedef = jax.tree.flatten(shapes)
  sizes = [tuple(np.shape(x)) for x in leaves]
  by_dtype: dict[Any, list[int]] = {}
  for i, leaf in enumerate(leaves):
    if 1 <= math.prod(sizes[i]) <= 4096:
      by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)
  chosen = (g for g in by_dtype.values() if len(g) >= 16)
  groups = tuple(g for c in chosen for g in _split(c, sizes, 8192) if len(g) > 1)
  if not groups:
    return None
  packed = {i for group in groups for i in group}
  rest = tuple(i for i in range(len(leaves)) if i not in packed)
  return Packing(treedef, tuple(sizes), groups, rest)


def unpack(acc: Packed) -> Any:
  """``acc`` as one sum: every leaf in its own shape (on the host if it is there)."""
  if _abstract(acc):
    return jax.eval_shape(unpack, acc)
  on_host = all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(acc))
  xp = np if on_host else jnp
  packing = acc.packing
  out: list[Any] = [None] * len(packing.shapes)
  for i, leaf in zip(packing.rest, acc.rest, strict=True):
    out[i] = leaf
  for group, buffer in zip(packing.groups, acc.groups, strict=True):
    start = 0
    for i in group:
      stop = start + math.prod(packing.shapes[i])
      out[i] = xp.reshape(buffer[start:stop], packing.shapes[i])
      start = stop
  return jax.tree.unflatten(packing.treedef, out)


def _traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _abstract(tree: Any) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


# -- per replica ----------------------------------------------------------------


def replicas(acc: PerReplica) -> int:
  """The number of replicas ``acc`` holds partial sums for."""
  return int(np.shape(jax.tree.leaves(acc.sums)[0])[0])


def first_replica(total: jax.Array, n: int) -> jax.Array:
  """``total`` as the first of ``n`` replicas' partial sums (zeros for the
  others): a select, so that a sharded sum moves nothing."""
  first = (jnp.arange(n) == 0).reshape((n,) + (1,) * jnp.ndim(total))
  return jnp.where(first, total[None], jnp.zeros((), total.dtype))


# -- any layout to any other ----------------------------------------------------


def one_sum(acc: Any) -> Any:
  """``acc`` in any layout as one sum (exact but for the partial sums' add)."""
  if isinstance(acc, Packed):
    return unpack(acc)
  if isinstance(acc, PerReplica):
    return jax.tree.map(lambda a: jnp.sum(a, axis=0, dtype=a.dtype), acc.sums)
  return acc


def relayout(state: MultiStepsState, like: MultiStepsState) -> MultiStepsState:
  """``state`` with its accumulator in the layout of ``like``'s.

  ``like`` is a state of the same params from ``opt.init(params)`` or, for a
  train step on a mesh, ``step.init(params)``. A sum becoming the first
  replica's partial sum is exact, and so is unpacking a checkpoint's packed
  sums (:class:`Packed`, written before packing was removed); partial sums for
  another layout are added up first (a rounding per add). Arrays take the
  placement of ``like``'s.

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
  if _same_layout(acc, target):
    return state
  # Outside a trace, no context mesh (under the user's jax.set_mesh, arrays
  # committed to other devices cannot meet): their own shardings place the work.
  traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, like)))
  with contextlib.nullcontext() if traced else jax.set_mesh(None):
    total = one_sum_shapes(acc)
    _checks.check_tree_matches(
      total,
      one_sum_shapes(target) if target is not None else total,
      name="state's accumulator",
      ref_name="`like`'s (relayout converts states of the same params; start a "
      "state for other params from opt.init(params))",
    )
    return state._replace(acc_grads=converted(acc, target))


def one_sum_shapes(acc: Any) -> Any:
  """Shapes of ``acc`` as one sum."""
  if isinstance(acc, Packed):
    return jax.eval_shape(unpack, acc)
  if isinstance(acc, PerReplica):
    return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), acc.sums
    )
  return acc


def converted(acc: Any, target: Any) -> Any:
  """``acc`` (any layout) in ``target``'s layout (``None``: one sum), placed like it.

  Exact, but partial sums of another number of replicas are added up first; as
  many keep their places in the stack, and one sum becomes the first replica's
  partial sum (the others zeros), so a window in progress carries on exactly."""
  if target is None:
    return one_sum(acc)
  if isinstance(target, PerReplica):
    n = replicas(target)
    if isinstance(acc, PerReplica) and replicas(acc) == n:
      return PerReplica(jax.tree.map(_placed_like, acc.sums, target.sums), target.axes)
    total = one_sum(acc)
    sums = jax.tree.map(lambda t, a: _first_placed(t, n, a), total, target.sums)
    return PerReplica(sums, target.axes)
  return jax.tree.map(_placed_like, one_sum(acc), target)


def _placed_like(x: Any, like: Any) -> Any:
  """``x`` in ``like``'s dtype and, where it has one, sharding."""
  placed = isinstance(like, jax.Array | jax.ShapeDtypeStruct)
  sharding = like.sharding if placed and not _traced(like) else None
  if not isinstance(x, jax.Array) or x.dtype != like.dtype:
    x = jnp.asarray(x, like.dtype)
  return x if sharding is None or _traced(x) else _put(x, sharding)


def _put(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """``x`` with ``sharding``: itself where it has it already."""
  if x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  return jax.device_put(x, sharding)


def _first_placed(total: Any, n: int, like: Any) -> Any:
  """``total`` as the first of ``n`` partial sums, placed as ``like``."""
  sharding = getattr(like, "sharding", None)
  total = jnp.asarray(total, like.dtype)
  if isinstance(sharding, NamedSharding):
    inner = NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return _first_replica(sharding)(_put(total, inner), n)
  out = first_replica(total, n)
  return jax.device_put(out, sharding) if sharding is not None else out


@functools.cache
def _first_replica(sharding: NamedSharding) -> Any:
  """:func:`first_replica` as a program whose result is placed as
  ``sharding``: each device computes its own slice, nothing moves."""
  return jax.jit(first_replica, static_argnums=1, out_shardings=sharding)


def _same_layout(acc: Any, target: Any) -> bool:
  """Whether ``acc`` is in ``target``'s layout, shapes included."""
  structure = jax.tree.structure(acc)
  if structure != jax.tree.structure(target):  # type: ignore[operator]  # jaxlib stub gap
    return False
  shapes = [np.shape(x) for x in jax.tree.leaves(acc)]
  return shapes == [np.shape(x) for x in jax.tree.leaves(target)]

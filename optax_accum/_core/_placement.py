"""Where arrays live: the devices and meshes a tree spans, and placing a tree
as another is placed (every layout and the step's host side ask here).

Examples:
  >>> import jax, jax.numpy as jnp
  >>> devices({"w": jnp.ones(3)})
  1
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum._core import _checks, _reduction


def traced(*trees: Any) -> bool:
  """Whether any leaf of ``trees`` is a tracer. An argument that is a bool or
  an array is its own leaf: a step's per-call probes walk no tree."""
  tracer, walk = jax.core.Tracer, []
  for tree in trees:
    if isinstance(tree, tracer):
      return True
    if not isinstance(tree, (bool, jax.Array)):
      walk.append(tree)
  return bool(walk) and any(isinstance(x, tracer) for x in jax.tree.leaves(walk))


def devices(tree: Any) -> int:
  """How many devices ``tree`` spans, by its arrays, its shapes' shardings and
  its tracers' ``Explicit`` meshes."""
  found: set[Any] = set()
  most = 1
  for x in jax.tree.leaves(tree):
    if traced(x):
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
  arrays = (x for x in jax.tree.leaves(inputs) if concrete(x))
  first = next((x for x in arrays if x.committed), None)
  if first is None or len(first.devices()) != 1:
    return tree

  def commit(x: Any) -> Any:
    return jax.device_put(x, first.sharding) if concrete(x) and not x.committed else x

  return jax.tree.map(commit, tree)


def concrete(x: Any) -> bool:
  """Whether ``x`` is an array with values (not a tracer)."""
  return isinstance(x, jax.Array) and not traced(x)


def placed_like(x: Any, like: Any) -> Any:
  """``x`` in ``like``'s dtype and, where it has one, sharding (itself where
  it has them already)."""
  placed = isinstance(like, jax.Array | jax.ShapeDtypeStruct)
  sharding = like.sharding if placed and not traced(like) else None
  if not isinstance(x, jax.Array) or x.dtype != like.dtype:
    x = jnp.asarray(x, like.dtype)
  if sharding is None or traced(x) or x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  return jax.device_put(x, sharding)


def axes_of(param: Any) -> tuple[str, ...]:
  """The mesh axes ``param`` is split over."""
  sharding = getattr(param, "sharding", None)
  spec = sharding.spec if isinstance(sharding, NamedSharding) else ()
  return tuple(a for entry in spec for a in _checks.axes(entry))


def spec_on(mesh: jax.sharding.Mesh, x: Any) -> tuple[Any, ...]:
  """``x``'s spec, an entry per dim, if it has a ``NamedSharding`` on ``mesh``."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
    return tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  return ()


def mesh_of(*trees: Any) -> jax.sharding.Mesh | None:
  """The mesh of the first leaf placed with a ``NamedSharding``, if any."""
  for leaf in jax.tree.leaves(trees):
    sharding = getattr(leaf, "sharding", None)
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    if isinstance(mesh, jax.sharding.Mesh):
      return mesh
  return None


def as_returned(tree: Any, inputs: Any) -> Any:
  """``tree`` placed as a jitted program returns it for ``inputs``, so the next
  call hits ``jit``'s cache: on ``inputs``' mesh, specs spelled out to full
  rank without copying (``P()`` returns as ``P(None, None)``, another cache
  key) and arrays on no mesh replicated; else :func:`committed`."""
  if (mesh := mesh_of(inputs)) is None:
    return committed(tree, inputs)

  def place(x: Any) -> Any:
    if not concrete(x):
      return x
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
      return jax.device_put(x, NamedSharding(mesh, P()))
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    if tuple(sharding.spec) == spec:
      return x
    full = NamedSharding(sharding.mesh, P(*spec, unreduced=sharding.spec.unreduced))
    shards = [shard.data for shard in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, full, shards)

  return jax.tree.map(place, tree)


def typed_like(x: Any, like: Any) -> jax.Array:
  """``x`` typed as ``like`` (an array or an abstract value): in its dtype,
  varying over the same manual axes, and split alike on an ``Explicit`` mesh (an
  inner state built with ``jnp.zeros(p.shape)`` is replicated; its update may
  split it)."""
  varying = getattr(getattr(like, "manual_axis_type", None), "varying", ())
  x = _reduction.varying_over(jnp.asarray(x).astype(like.dtype), varying)
  aval = like if isinstance(like, jax.ShapeDtypeStruct) else jax.typeof(like)
  want = getattr(aval, "sharding", None)
  have = getattr(jax.typeof(x), "sharding", None)
  if not (isinstance(want, NamedSharding) and isinstance(have, NamedSharding)):
    return x
  split = have.spec != want.spec and want.mesh.are_all_axes_explicit
  return jax.sharding.reshard(x, want.spec) if split else x

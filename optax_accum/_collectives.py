"""Summing per-replica values over data-parallel axes inside shard_map or pmap."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

AxisName = str | tuple[str, ...]


def _varying(x: Any) -> frozenset[str]:
  """The manual mesh axes over which ``x`` differs between replicas."""
  return jax.typeof(x).manual_axis_type.varying


def varying_over(x: Any, axes: Iterable[str]) -> jax.Array:
  """``x``, marked as differing per replica over ``axes`` (``shard_map`` types).

  Only the axes ``x`` is not marked with already are added; outside
  ``shard_map`` (no axes to add) ``x`` comes back as it is.
  """
  missing = tuple(sorted(set(axes) - _varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else jnp.asarray(x)


class ReplicaSum:
  """Sums values over the mesh axes on which they still differ per replica.

  Under ``pmap`` or ``shard_map(check_vma=False)`` JAX does not track which
  values vary per replica, so every value is taken to be per-replica and
  summed. Under ``shard_map`` with the default ``check_vma=True`` it does: a
  value already invariant over an axis (a gradient that JAX's autodiff summed
  because the params entered replicated) is not summed again.
  """

  def __init__(self, axis_name: AxisName):
    self.axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    try:
      probes = [jax.lax.axis_index(axis) for axis in self.axes]
    except NameError as e:
      raise ValueError(
        f"`axis_name` {axis_name!r} is not a mesh axis here: call inside "
        "shard_map or pmap over it, or drop `axis_name` under plain jit, where "
        "sharded gradients are already global."
      ) from e
    self.tracked = any(
      axis in _varying(probe) for axis, probe in zip(self.axes, probes, strict=True)
    )

  def local_axes(self, x: Any) -> tuple[str, ...]:
    """The axes over which ``x`` may still differ between replicas."""
    if not self.tracked:
      return self.axes
    varying = _varying(x)
    return tuple(axis for axis in self.axes if axis in varying)

  def __call__(self, x: Any) -> jax.Array:
    axes = self.local_axes(x)
    return jax.lax.psum(x, axes) if axes else x


def replica_index(axis_name: AxisName) -> jax.Array:
  """This replica's position over the mesh axes ``axis_name`` (row-major).

  Inside ``shard_map`` or ``pmap`` only.
  """
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  index = jnp.zeros([], jnp.int32)
  for axis in axes:
    index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return index


def replica_max(tree: Any, summed: ReplicaSum) -> Any:
  """``tree`` made the same on every replica: each leaf's maximum over them.

  A value that is already the same everywhere keeps it; a per-replica count or
  flag becomes the largest (for a bool: whether any replica's is true).
  """

  def combine(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    axes = summed.local_axes(x)
    if not axes:
      return x
    if x.dtype == jnp.bool_:
      return jax.lax.pmax(x.astype(jnp.int32), axes) > 0
    return jax.lax.pmax(x, axes)

  return jax.tree.map(combine, tree)


def on_any_shard(
  flag: jax.Array, axis_name: AxisName | None = None, *, window: Any = ()
) -> jax.Array:
  """Whether ``flag`` is true on any shard of the same window, on all of them.

  Inside ``shard_map`` the flag is combined over the mesh axes it varies over
  but the ``window`` values (its weights) do not: model-parallel shards of one
  window agree, independent per-device windows stay independent. Under
  ``pmap`` or ``check_vma=False``, where JAX does not track that, it is
  combined over ``axis_name`` only. Outside both it is ``flag``.
  """
  count = jnp.asarray(flag).astype(jnp.int32)
  own = frozenset().union(*[_varying(x) for x in jax.tree.leaves(window)])
  shared = tuple(sorted(_varying(count) - own))
  if shared:
    count = jax.lax.psum(count, shared)
  if axis_name is not None:
    count = ReplicaSum(axis_name)(count)
  return count > 0

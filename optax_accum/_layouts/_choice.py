"""Which layout a train step lays a state out in, written once: at
``step.init`` (:func:`for_init`) or for a state the step did not return
(:func:`kept`, else :func:`for_call`); the step keeps it after.

With ``axis_name`` under plain ``jit``: per-replica partial sums over its axes
(``_layout.per_replica``). Without, on an ``Explicit`` mesh: deferred partial
sums over the ``Explicit`` axes that split the rows and no param
(``_layout.deferred``). Else one sum. Params split over the data axes (FSDP,
ZeRO) keep one sum: a partial sum would need a whole copy of each on every
device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from optax_accum._core import _placement
from optax_accum._core._checks import axes as _axes
from optax_accum._core._state import MultiStepsConfig, StoredNode
from optax_accum._layouts._layout import ONE_SUM, Layout, deferred, per_replica
from optax_accum._layouts._packed import Packed
from optax_accum._layouts._storage import PerReplica, replica_count

#: ``choose(mesh, axes)``: a deferred layout over ``axes``, its leaves picked.
Choose = Callable[[Mesh, tuple[str, ...]], Layout]


def kept(acc: Any) -> Layout | None:
  """The layout a state stored as ``acc`` keeps on any devices: one sum stays
  one sum, a packed node becomes one, a node new to the library keeps its own;
  ``None`` for partial sums (the call's devices decide: :func:`for_call`)."""
  match acc:
    case PerReplica():
      return None
    case Packed():
      return ONE_SUM
    case StoredNode():
      return acc.layout()  # type: ignore[attr-defined]
    case _:
      return ONE_SUM


def for_init(params: Any, config: MultiStepsConfig) -> Layout:
  """``step.init``'s layout for ``params`` (their mesh decides)."""
  mesh = _placement.mesh_of(params)
  if mesh is None:
    return ONE_SUM
  taken = _param_axes(params)
  axes = _axes(config.axis_name)
  if axes:
    return ONE_SUM if taken & set(axes) else per_replica(mesh, axes)
  free = tuple(a for a in mesh.explicit_axes if a not in taken)
  if not defers(config) or replica_count(mesh, free) <= 1:
    return ONE_SUM
  return deferred(mesh, free, (False,) * len(jax.tree.leaves(params)))


def for_call(
  params: Any, batch: Any, config: MultiStepsConfig, *, scan: bool, choose: Choose
) -> Layout | None:
  """The partial sums of a call whose ``batch`` rows are split over data axes,
  or ``None``; ``choose(mesh, axes)`` picks a deferred layout's leaves. With
  ``axis_name`` a ``ValueError`` unless each batch leaf's rows are split over
  exactly its axes and no param is."""
  dim = 1 if scan else 0
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  rows = [(path, getattr(leaf, "sharding", None)) for path, leaf in flat]
  # Each leaf's mesh (None off a mesh) and the axes its rows are split over.
  found = {(getattr(s, "mesh", None), _rows(s, dim)) for _, s in rows}
  axes = _axes(config.axis_name)
  if axes:
    for path, sharding in rows:
      if (got := _rows(sharding, dim)) != axes:
        raise ValueError(_unsplit_rows(config.axis_name, path, got, scan))
    if len(found) != 1:
      raise ValueError(f"The batch's leaves lie on {len(found)} different meshes.")
    for path, param in jax.tree_util.tree_flatten_with_path(params)[0]:
      if both := set(_placement.axes_of(param)) & set(axes):
        raise ValueError(_fsdp(path, sorted(both)[0]))
    return per_replica(found.pop()[0], axes)
  if not defers(config) or len(found) != 1:
    return None
  mesh, axes = found.pop()
  if not isinstance(mesh, Mesh) or not axes:
    return None
  if set(axes) - set(mesh.explicit_axes) or replica_count(mesh, axes) == 1:
    return None  # Auto axes have no ``reduced`` type; one device, nothing to add.
  shardings = [getattr(p, "sharding", None) for p in jax.tree.leaves(params)]
  if not all(isinstance(s, NamedSharding) and s.mesh == mesh for s in shardings):
    return None
  if _param_axes(params) & set(axes):
    return None  # FSDP's gradients are reduce-scattered.
  return choose(mesh, axes)


def defers(config: MultiStepsConfig) -> bool:
  """Whether ``config`` can defer: ``"skip_micro_batch"`` checks and
  ``noise_scale`` measures each micro-batch's whole gradient."""
  return config.on_nonfinite != "skip_micro_batch" and not config.noise_scale


def _rows(sharding: Any, dim: int) -> tuple[str, ...]:
  """The mesh axes a batch leaf's rows (dimension ``dim``) are split over."""
  if not isinstance(sharding, NamedSharding) or len(sharding.spec) <= dim:
    return ()
  return _axes(sharding.spec[dim])


def _param_axes(params: Any) -> set[str]:
  """The mesh axes any param is split over."""
  return {a for p in jax.tree.leaves(params) for a in _placement.axes_of(p)}


def _unsplit_rows(axis_name: Any, path: Any, got: tuple[str, ...], scan: bool) -> str:
  return (
    f"`axis_name` {axis_name!r} outside shard_map: the step sums each "
    "replica's gradient once per window, so every batch leaf must be a "
    f"jax.Array split over {axis_name!r} along its "
    f"{'second (rows) axis in scan mode' if scan else 'rows (first axis)'};"
    f" batch{jax.tree_util.keystr(path)} is split over {got or 'nothing'}. "
    f"Place it with jax.device_put(batch, NamedSharding(mesh, "
    f"P({'None, ' if scan else ''}{axis_name!r}))), or drop axis_name."
  )


def _fsdp(path: Any, axis: str) -> str:
  return (
    f"params{jax.tree_util.keystr(path)} is split over the data axis "
    f"{axis!r} (FSDP, ZeRO): a per-replica partial sum would "
    "need a whole copy of it on every device. Drop axis_name: under "
    "plain jit XLA then reduce-scatters each micro-batch's gradient."
  )

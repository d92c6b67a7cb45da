"""Per-replica accumulators: one gradient reduction per window under plain jit.

With ``axis_name`` under plain ``jit`` on a batch split over it, the programs run
in a ``shard_map``: each replica adds its rows' gradient to its own partial sum,
reduced once when the window ends. Between calls a ``PerReplica`` holds the sums
on a leading replica axis split over the data axes: one params-sized sum a device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum._core import _checks, _layout, _reduction, _terms
from optax_accum._core._checks import axes as _axes
from optax_accum._core._layout import PerReplica
from optax_accum._core._reduction import AxisName
from optax_accum._core._state import MultiStepsState
from optax_accum._core._terms import Names
from optax_accum._step._one_sum import Layout, Mapped
from optax_accum._step._programs import Bodies
from optax_accum._step._signature import Body, Inputs, Outputs, renamed


@dataclasses.dataclass(frozen=True)
class PerReplicaLayout(Layout):
  """Partial sums over ``axes``, added in a ``shard_map``; stored as ``PerReplica``."""

  mesh: jax.sharding.Mesh
  axes: tuple[str, ...]
  converts: ClassVar[bool] = True

  @property
  def replicas(self) -> int:
    return math.prod(self.mesh.shape[axis] for axis in self.axes)

  def spec(self, *rest: Any) -> P:
    """A spec whose leading dimension is split over the data axes."""
    return P(self.axes[0] if len(self.axes) == 1 else self.axes, *rest)

  def stored(
    self, state: MultiStepsState, params: Any = None, terms: Names = None
  ) -> MultiStepsState:
    acc = state.acc_grads
    sums = _layout.one_sum_shapes(acc)
    _check_params(params, sums, terms)
    target = self.like(sums, params, terms)
    return state._replace(acc_grads=_layout.converted(acc, target))

  def like(self, sums: Any, params: Any, terms: Names = None) -> PerReplica:
    """Shapes of ``sums`` (one per term) as stored: a leading replica axis split
    over the data axes, each partial sum split like its param on other axes."""

    def stacked(a: Any, p: Any) -> jax.ShapeDtypeStruct:
      rest = _spec_on(self.mesh, p) or (None,) * jnp.ndim(p)
      sharding = NamedSharding(self.mesh, self.spec(*rest))
      return jax.ShapeDtypeStruct((self.replicas, *a.shape), a.dtype, sharding=sharding)

    trees = _terms.per_term(sums, terms)
    stacks = tuple(jax.tree.map(stacked, tree, params) for tree in trees)
    return PerReplica(_terms.stored(stacks, terms), self.axes)

  def bodies(self, bodies: Bodies) -> Bodies:
    return bodies.under(_reduction.policy(self.axes, at_window_end=True))

  def body(self, body: Body, window: bool) -> Body:
    """``body`` on this replica's slice of the accumulator's replica axis;
    ``aux`` gains a replica axis (after the micro-batch axis of a window)."""

    def run(inputs: Inputs) -> Outputs:
      out = body(inputs._replace(acc=jax.tree.map(lambda a: a[0], inputs.acc)))
      return out._replace(acc=_stack(out.acc), aux=_stack(out.aux, int(window)))

    return renamed(run, body)

  def mapped(self, window: bool) -> Mapped | None:
    """A ``shard_map`` splitting the accumulator, rows and ``aux`` over ``axes``."""
    rows = P(None, *self.spec()) if window else self.spec()
    split, whole = self.spec(), P()
    inputs = Inputs(whole, whole, split, whole, rows, whole, whole)
    outputs = Outputs(whole, whole, split, whole, whole, rows)

    def mapped(flat: Any) -> Any:
      return jax.shard_map(
        flat,
        mesh=self.mesh,
        in_specs=tuple(inputs),
        out_specs=outputs,
        axis_names=set(self.axes),
      )

    return mapped

  def inside(self, acc: PerReplica) -> Any:
    return acc.sums

  def outside(self, acc: Any) -> PerReplica:
    return PerReplica(acc, self.axes)


def data_layout(
  axis_name: AxisName, params: Any, batch: Any, *, scan: bool
) -> PerReplicaLayout:
  """The layout of ``batch`` split over ``axis_name``; ``ValueError`` unless each
  batch leaf's rows are split over exactly it and no params leaf is."""
  axes = _axes(axis_name)
  dim = 1 if scan else 0
  meshes = set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    sharding = getattr(leaf, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else ()
    got = _axes(spec[dim]) if len(spec) > dim else ()
    if got != axes:
      raise ValueError(
        f"`axis_name` {axis_name!r} outside shard_map: the step sums each "
        "replica's gradient once per window, so every batch leaf must be a "
        f"jax.Array split over {axis_name!r} along its "
        f"{'second (rows) axis in scan mode' if scan else 'rows (first axis)'};"
        f" batch{jax.tree_util.keystr(path)} is split over {got or 'nothing'}. "
        f"Place it with jax.device_put(batch, NamedSharding(mesh, "
        f"P({'None, ' if scan else ''}{axis_name!r}))), or drop axis_name."
      )
    meshes.add(sharding.mesh)  # type: ignore[union-attr]
  if len(meshes) != 1:
    raise ValueError(f"The batch's leaves lie on {len(meshes)} different meshes.")
  mesh = meshes.pop()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    split = set(split_over(leaf)) & set(axes)
    if split:
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} is split over the data axis "
        f"{sorted(split)[0]!r} (FSDP, ZeRO): a per-replica partial sum would "
        "need a whole copy of it on every device. Drop axis_name: under "
        "plain jit XLA then reduce-scatters each micro-batch's gradient."
      )
  return PerReplicaLayout(mesh, axes)


def _check_params(params: Any, sums: Any, terms: Names) -> None:
  """Raises ``ValueError`` naming the first leaf of ``params`` that a state's
  sums (one tree per term, any layout) lack or hold in another shape."""
  for tree in _terms.per_term(sums, terms):
    _checks.check_tree_matches(
      params,
      tree,
      name="params",
      ref_name="the state's accumulator (step.init of the params it was made "
      "for; a state of other params starts from step.init(params))",
    )


def split_over(param: Any) -> tuple[str, ...]:
  """The mesh axes ``param`` is split over."""
  sharding = getattr(param, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return ()
  return tuple(a for entry in sharding.spec for a in _axes(entry))


def _spec_on(mesh: jax.sharding.Mesh, x: Any) -> tuple[Any, ...]:
  """``x``'s spec, an entry per dim, if it has a ``NamedSharding`` on ``mesh``."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
    return tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  return ()


def mesh_of(*trees: Any) -> jax.sharding.Mesh | None:
  """The mesh of the first leaf placed with a ``NamedSharding``, if any."""
  for leaf in jax.tree.leaves(trees):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(
      sharding.mesh, jax.sharding.Mesh
    ):
      return sharding.mesh
  return None


def as_returned(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """``tree`` placed as the programs return it, so the next call hits ``jit``'s
  cache: specs spelled out to full rank without copying (``P()`` returns as
  ``P(None, None)``, another cache key); arrays on no mesh replicated."""

  def place(x: Any) -> Any:
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
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


def _stack(tree: Any, axis: int = 0) -> Any:
  """``tree`` with a replica axis at ``axis``."""
  return jax.tree.map(lambda a: jnp.expand_dims(a, axis), tree)

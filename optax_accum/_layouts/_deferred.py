"""Deferred partial sums: one gradient reduction per window under plain ``jit``,
no ``axis_name``.

On an ``Explicit`` mesh whose data axes split the batch's rows but no param, the
programs cast params to ``reduced``, so gradients stay ``unreduced`` per-device
partial sums, reduced once a window (``_reduction.Deferred``) and stored as
:class:`~optax_accum.PerReplica` (same checkpoints); the loss sees the global
batch. JAX 0.10 refuses some ops on a ``reduced`` operand (a bias or norm scale
added to data-split activations): such small leaves, found by tracing, keep
per-micro-batch reduction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum._core._reduction import Deferred
from optax_accum._layouts._per_replica import PerReplicaLayout
from optax_accum._layouts._protocol import Body, Sharded, renamed


@dataclasses.dataclass(frozen=True)
class DeferredLayout(PerReplicaLayout):
  """Per-device partial sums over ``Explicit`` axes ``axes``, added in the global
  view; ``leaves``: per params leaf, whether its gradient stays partial."""

  leaves: tuple[bool, ...] = ()

  def policy(self) -> Any:
    return Deferred(mesh=self.mesh, over=self.axes, leaves=self.leaves)

  def body(self, body: Body, window: bool) -> Body:
    """``body`` adding to each device's partial sum of the stacked accumulator."""

    def run(inputs: Any) -> Any:
      out = body(inputs._replace(acc=_relaid(self, inputs.acc, inside=True)))
      return out._replace(acc=_relaid(self, out.acc, inside=False))

    return renamed(run, body)

  def sharded(self, window: bool) -> Sharded | None:
    return None


def choose_leaves(
  layout: DeferredLayout, fits: Callable[[DeferredLayout], bool], params: Any
) -> DeferredLayout:
  """``layout`` deferring the largest set of 2+-D leaves ``fits`` accepts; the
  others' gradients, reduced by XLA, join the first replica's partial sum."""
  flat = jax.tree.leaves(params)
  wanted = [i for i, p in enumerate(flat) if jnp.ndim(p) >= 2]

  def with_leaves(chosen: Sequence[int]) -> DeferredLayout:
    flags = tuple(i in chosen for i in range(len(flat)))
    return dataclasses.replace(layout, leaves=flags)

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


def _relaid(layout: PerReplicaLayout, acc: Any, inside: bool) -> Any:
  """The accumulator as programs add to it (``inside``: ``unreduced`` partial
  sums) or as stored (stacked on a replica axis). No data moves: an unchecked
  ``shard_map`` (``unreduced`` to per-device values has no typed cast)."""

  def relaid(x: jax.Array) -> jax.Array:
    rest = jax.typeof(x).sharding.spec.partitions[1 if inside else 0 :]
    unreduced = P(*rest, unreduced=set(layout.axes))
    if inside:
      fn, in_spec, out_spec = (lambda s: s[0]), layout.spec(*rest), unreduced
    else:
      fn, in_spec, out_spec = (lambda v: v[None]), unreduced, layout.spec(*rest)
    return jax.shard_map(
      fn, mesh=layout.mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False
    )(x)

  return jax.tree.map(relaid, acc)


def micro_batch_like(batch: Any) -> Any:
  """Shapes of one micro-batch of a scan-mode ``batch`` (its first entry)."""

  def one(x: Any) -> jax.ShapeDtypeStruct:
    sharding = x.sharding
    spec = P(*tuple(sharding.spec)[1:])
    return jax.ShapeDtypeStruct(
      x.shape[1:], x.dtype, sharding=NamedSharding(sharding.mesh, spec)
    )

  return jax.tree.map(one, batch)

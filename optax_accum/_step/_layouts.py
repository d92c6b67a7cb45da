"""Which accumulator layout a train step's call runs in (the init chooses it,
the step keeps it), and each layout's programs, built once."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding

from optax_accum._core import _checks, _layout
from optax_accum._core._layout import PerReplica, committed
from optax_accum._core._multi_steps import MultiStepsState
from optax_accum._step import _deferred
from optax_accum._step._deferred import DeferredLayout
from optax_accum._step._one_sum import ONE_SUM, Layout, programs
from optax_accum._step._programs import Bodies, counters
from optax_accum._step._replicas import (
  PerReplicaLayout,
  as_returned,
  data_layout,
  mesh_of,
  split_over,
)
from optax_accum._step._signature import Inputs, Pair


def is_traced(*trees: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


class Layouts:
  """A train step's choice of layout for each call, and the programs of each."""

  def __init__(self, bodies: Bodies, mode: str, donate: bool):
    self.bodies = bodies
    self.scan = mode == "scan"
    self.donate = donate
    self._built: dict[Layout, Pair] = {}
    self._chosen: dict[Any, DeferredLayout] = {}

  def arranged(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any = None
  ) -> tuple[Any, MultiStepsState, Layout]:
    """Params, ``opt_state`` in the call's layout, and that layout: if traced or on
    no mesh one sum (see :meth:`restacked`), else per-replica where it can."""
    traced = is_traced(params, opt_state, batch)
    mesh = None if traced else mesh_of(params, batch)
    if traced or (mesh is None and not self._replica_axes):
      opt_state = self.stored(opt_state, ONE_SUM)
      if traced:
        return params, opt_state, ONE_SUM
      return (*committed((params, opt_state), (params, batch)), ONE_SUM)
    if mesh is not None:
      params, opt_state = as_returned((params, opt_state), mesh)
    layout = self._data_layout(params, opt_state, batch, rng) or ONE_SUM
    return params, self.stored(opt_state, layout, params), layout

  def stored(
    self, opt_state: MultiStepsState, layout: Layout, params: Any = None
  ) -> MultiStepsState:
    """``opt_state`` with its accumulator in ``layout`` (kept if it is)."""
    return layout.stored(opt_state, params, self.bodies.config.terms)

  def _data_layout(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any
  ) -> PerReplicaLayout | None:
    """The per-replica layout of a call on a mesh, if it has one."""
    if self._replica_axes:
      named = self.bodies.config.axis_name or ()  # As the user wrote it.
      return data_layout(named, params, batch, scan=self.scan)
    return self._deferred_layout(params, opt_state, batch, rng)

  def init_layout(self, params: Any) -> Layout:
    """``step.init``'s layout: on a mesh, partial sums over ``axis_name`` or else the
    ``Explicit`` axes no param is split over; else one sum."""
    mesh = mesh_of(params)
    layout = None if mesh is None else self._init_per_replica(params, mesh)
    return layout or ONE_SUM

  def _init_per_replica(self, params: Any, mesh: Any) -> PerReplicaLayout | None:
    config = self.bodies.config
    split = {a for p in jax.tree.leaves(params) for a in split_over(p)}
    if self._replica_axes:
      axes = self._replica_axes
      return None if split & set(axes) else PerReplicaLayout(mesh, axes)
    if not _deferred.defers(config):
      return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    axes = tuple(
      a for a in mesh.axis_names if types[a] == AxisType.Explicit and a not in split
    )
    if math.prod(mesh.shape[a] for a in axes) <= 1:
      return None
    return DeferredLayout(mesh, axes, (False,) * len(jax.tree.leaves(params)))

  def on_one_sum(self, params: Any, inner: Any, batch: Any) -> bool:
    """Whether an empty-window call runs on one sum: traced or no mesh."""
    if is_traced(params, inner, batch):
      return True
    return mesh_of(params, batch) is None and not self._replica_axes

  def restacked(self, given: Any, opt_state: MultiStepsState) -> MultiStepsState:
    """Traced: ``opt_state``'s one sum as replica 0's partial sum, stacked as
    ``given``, so a ``scan`` carry keeps its type; else ``opt_state``."""
    if not isinstance(given, PerReplica) or isinstance(opt_state.acc_grads, PerReplica):
      return opt_state
    n = _layout.replicas(given)

    def stack(total: Any, like: Any) -> Any:
      out = _layout.first_replica(total, n)
      sharding = getattr(jax.typeof(like), "sharding", None)
      if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        out = jax.sharding.reshard(out, sharding)
      return out

    sums = jax.tree.map(stack, opt_state.acc_grads, given.sums)
    return opt_state._replace(acc_grads=PerReplica(sums, given.axes))

  @property
  def _replica_axes(self) -> tuple[str, ...]:
    """The step's ``axis_name`` as a tuple (``()`` for none)."""
    return _checks.axes(self.bodies.config.axis_name)

  def _deferred_layout(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any
  ) -> DeferredLayout | None:
    """The deferred layout this call allows, or ``None``; chosen once per avals."""
    config = self.bodies.config
    layout = _deferred.candidate(params, batch, config, scan=self.scan)
    if layout is None:
      return None
    key = (layout, *map(avals, (params, batch)), rng is None)
    if key not in self._chosen:
      sums = jax.eval_shape(self.bodies.optimizer.init, params).acc_grads
      acc = layout.like(sums, params, config.terms).sums
      micro_batch = _deferred.micro_batch_like(batch) if self.scan else batch
      inputs = Inputs(params, None, acc, counters(opt_state), micro_batch, rng)

      def fits(chosen: DeferredLayout) -> bool:
        body = chosen.body(chosen.bodies(self.bodies).accumulate, window=False)
        try:
          jax.eval_shape(body, inputs)
        except Exception:  # A cast JAX has no rule for (or a loss that fails
          return False  # anyway: with nothing cast, the call raises it).
        return True

      self._chosen[key] = _deferred.choose_leaves(layout, fits, params)
    return self._chosen[key]

  def programs(self, layout: Layout) -> Pair:
    """The accumulate and update programs for one accumulator layout."""
    if layout not in self._built:
      built = programs(layout, self.bodies, scan=self.scan, donate=self.donate)
      self._built[layout] = built
    return self._built[layout]


def avals(tree: Any) -> tuple[Any, ...]:
  """What a jit cache sees of ``tree``: structure, shapes, dtypes, shardings."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(
    (jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves
  )

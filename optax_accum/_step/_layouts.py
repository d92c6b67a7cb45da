"""Where a train step's accumulator lives for a call, and the programs for it.

The state's structure says the layout (:mod:`optax_accum._core._layout`): one
sum, :class:`~optax_accum._core._layout.Packed` (``step.init(params)`` on one
device, many small leaves: :mod:`optax_accum._step._packing`) or
:class:`~optax_accum._core._layout.PerReplica` partial sums under plain ``jit``
(``step.init(params)`` on a mesh): added in a ``shard_map`` with ``axis_name``
(:mod:`optax_accum._step._replicas`), or in the global view with gradients left
``unreduced`` on an ``Explicit`` mesh (:mod:`optax_accum._step._deferred`).
The init chooses the layout and the step keeps it; only on a mesh, called
from Python, the host converts a state the step did not return last to the
layout of the call (traced, the step returns the layout it was given). The
programs for each layout are built once.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding

from optax_accum._core import _backend, _checks, _layout, _reduction, _terms
from optax_accum._core._layout import Packed, Packing, PerReplica
from optax_accum._core._multi_steps import MultiSteps, MultiStepsState
from optax_accum._step import _deferred
from optax_accum._step._packing import PackedBodies, PackedProgram
from optax_accum._step._programs import Bodies, counters
from optax_accum._step._replicas import (
  DataLayout,
  PerReplicaProgram,
  as_returned,
  data_layout,
  mesh_of,
  per_replica,
  sharded_programs,
)
from optax_accum._step._signature import (
  ACCUMULATE_DONATES,
  UPDATE_DONATES,
  Body,
  Inputs,
  Pair,
  Program,
  Split,
)

#: Where the accumulator lives for a call: one sum (``None``), packed, or
#: per-replica partial sums.
Layout = DataLayout | Packing | None


def is_traced(*trees: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


class Layouts:
  """A train step's accumulator layouts and the programs for each.

  ``one_sum``: the programs of ``bodies`` for a state with one sum.
  """

  def __init__(self, bodies: Bodies, mode: str, donate: bool, one_sum: Pair):
    self.bodies = bodies
    self.mode = mode
    self.donate = donate
    self.one_sum = one_sum
    self._built: dict[DataLayout | Packing, Pair] = {}
    self._chosen: dict[Any, DataLayout | None] = {}
    self._packings: dict[Any, Packing | None] = {}
    # The platform params of each packing live on: its programs' backend.
    self._platforms: dict[Packing, str] = {}

  def arranged(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any = None
  ) -> tuple[Any, MultiStepsState, Layout]:
    """Params and ``opt_state`` as this call runs with them: placed as the
    programs return them (see :func:`as_returned`), the accumulator in this
    call's layout.

    Traced (inside the user's ``jit`` or ``scan``), the state's own layout:
    a packed state runs the packed programs, per-replica partial sums are
    added up here and restacked by :meth:`restacked`. From Python: on no mesh
    the state's own layout too (packed from ``step.init(params)``, one sum
    from ``opt.init(params)``: the init chooses, every path keeps it); under
    plain ``jit`` with ``axis_name``, or with a batch split over ``Explicit``
    data axes, per-replica partial sums. Called for a state the step did not return last
    (and in scan mode on every call).
    """
    acc = opt_state.acc_grads
    if is_traced(params, opt_state, batch):
      if isinstance(acc, Packed):
        return params, opt_state, acc.packing
      return params, self.in_layout(opt_state, None), None
    mesh = mesh_of(params, batch)
    if mesh is None and not self._replica_axes:
      packing = acc.packing if isinstance(acc, Packed) else None
      return params, self.in_layout(opt_state, packing), packing
    if mesh is not None:
      params, opt_state = as_returned((params, opt_state), mesh)
    layout = self._data_layout(params, opt_state, batch, rng)
    return params, self.in_layout(opt_state, layout, params), layout

  def _data_layout(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any
  ) -> DataLayout | None:
    """The per-replica layout of a call on a mesh, if it has one."""
    if self._replica_axes:
      scan = self.mode == "scan"
      named = self.bodies.config.axis_name or ()  # As the user wrote it.
      return data_layout(named, params, batch, scan=scan)
    return self._deferred_layout(params, opt_state, batch, rng)

  def init_layout(self, params: Any) -> DataLayout | None:
    """The per-replica layout ``step.init(params)`` gives, from params and
    the step's settings alone: with ``axis_name``, its axes on the params'
    mesh; without, on an ``Explicit`` mesh, the ``Explicit`` axes no param is
    split over (if they hold more than one replica)."""
    mesh = mesh_of(params)
    if mesh is None:
      return None
    config = self.bodies.config
    split = {a for p in jax.tree.leaves(params) for a in _split_over(p)}
    if self._replica_axes:
      axes = self._replica_axes
      return None if split & set(axes) else DataLayout(mesh, axes)
    if config.on_nonfinite == "skip_micro_batch" or config.noise_scale:
      return None  # Reduced per micro-batch (see _deferred.candidate).
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    axes = tuple(
      a for a in mesh.axis_names if types[a] == AxisType.Explicit and a not in split
    )
    if math.prod(mesh.shape[a] for a in axes) <= 1:
      return None
    return DataLayout(mesh, axes, (False,) * len(jax.tree.leaves(params)))

  def on_one_sum(self, params: Any, inner: Any, batch: Any) -> bool:
    """Whether a call starting an empty window runs on one sum, unpacked, in
    the programs of ``one_sum``: traced, or on no mesh. (A state without sums
    has nothing to pack.)"""
    if is_traced(params, inner, batch):
      return True
    return mesh_of(params, batch) is None and not self._replica_axes

  def restacked(self, given: Any, opt_state: MultiStepsState) -> MultiStepsState:
    """Traced: ``opt_state``'s one sum as the first replica's partial sum,
    stacked as ``given`` (a :class:`PerReplica` accumulator the call was
    given), so a ``scan`` carry keeps its type; else ``opt_state``."""
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

  def _accumulators(self, acc: Any) -> tuple[Any, ...]:
    """An accumulator (one sum or stacked), one per loss term."""
    return _terms.per_term(acc, self.bodies.config.terms)

  def _stored(self, accs: Any) -> Any:
    return _terms.stored(accs, self.bodies.config.terms)

  def packing(self, params: Any) -> Packing | None:
    """The packing the step keeps on one device (see
    :func:`optax_accum._core._layout.packing_for`), once per shapes."""
    key = avals(params)
    if key not in self._packings:
      optimizer = self.bodies.optimizer
      acc = jax.eval_shape(optimizer.init, params).acc_grads
      packing = _layout.packing_for(optimizer.config, params, acc)
      self._packings[key] = packing
      if packing is not None:
        self._platforms[packing] = _backend.platform_of(params)
    return self._packings[key]

  def in_layout(
    self, opt_state: MultiStepsState, layout: Layout, params: Any = None
  ) -> MultiStepsState:
    """``opt_state`` with its accumulator in ``layout`` (kept if it is):
    exact, but for partial sums of another layout, added up first."""
    acc = opt_state.acc_grads
    if isinstance(layout, Packing):
      if isinstance(acc, Packed) and acc.packing == layout:
        return opt_state
      return opt_state._replace(acc_grads=_layout.pack(_layout.one_sum(acc), layout))
    if isinstance(layout, DataLayout):
      if isinstance(acc, PerReplica) and acc.axes == layout.axes:
        stacked, one = acc.sums, None
      else:
        stacked, one = None, _layout.one_sum(acc)
      accs = self._accumulators(one if stacked is None else stacked)
      placed = [per_replica(a, params, layout, stacked is not None) for a in accs]
      return opt_state._replace(acc_grads=PerReplica(self._stored(placed), layout.axes))
    if isinstance(acc, Packed | PerReplica):
      return opt_state._replace(acc_grads=_layout.one_sum(acc))
    return opt_state

  def _deferred_layout(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any
  ) -> DataLayout | None:
    """The layout that reduces gradients once per window without
    ``axis_name`` (:mod:`optax_accum._step._deferred`), if this call allows one;
    chosen once per shapes and shardings of the arguments."""
    scan = self.mode == "scan"
    layout = _deferred.candidate(params, batch, self.bodies.config, scan=scan)
    if layout is None:
      return None
    key = (layout, *map(avals, (params, batch)), rng is None)
    if key not in self._chosen:
      acc = _stacked_like(self.bodies.optimizer, params, layout)
      micro_batch = _deferred.micro_batch_like(batch) if scan else batch
      inputs = Inputs(params, None, acc, counters(opt_state), micro_batch, rng)

      def fits(chosen: DataLayout) -> bool:
        bodies = self._bodies_under(_deferred.policy(chosen))
        try:
          jax.eval_shape(_deferred.accumulate_body(chosen, bodies), inputs)
        except Exception:  # A cast JAX has no rule for (or a loss that fails
          return False  # anyway: with nothing cast, the call raises it).
        return True

      chosen = _deferred.choose_leaves(layout, fits, params)
      # Nothing castable: every gradient XLA reduces goes to the first
      # replica's partial sum; the stored layout is the same.
      flags = (False,) * len(jax.tree.leaves(params))
      self._chosen[key] = chosen or layout._replace(deferred=flags)
    return self._chosen[key]

  def _bodies_under(self, policy: _reduction.Local) -> Bodies:
    """The step's program bodies under another reduction policy."""
    bodies = self.bodies
    return Bodies(bodies.loss_fn, bodies.optimizer, bodies.has_aux, policy)

  def programs(self, layout: Layout) -> Pair:
    """The accumulate and update programs for one accumulator layout."""
    if layout is None:
      return self.one_sum
    if layout not in self._built:
      scan = self.mode == "scan"
      if isinstance(layout, Packing):
        built = self._packed_programs(layout)
      elif layout.deferred is not None:
        bodies = self._bodies_under(_deferred.policy(layout))
        built = _deferred.programs(layout, bodies, scan=scan, donate=self.donate)
      else:
        bodies = self._bodies_under(_reduction.policy(layout.axes, at_window_end=True))
        built = sharded_programs(layout, bodies, scan=scan, donate=self.donate)
      if not isinstance(layout, Packing):
        built = Pair(*(PerReplicaProgram(layout.axes, p) for p in built))
      self._built[layout] = built
    return self._built[layout]

  def _packed_programs(self, packing: Packing) -> Pair:
    """The programs on a packed accumulator (one sum): a streamed window
    ends in two programs where the backend says so (``two_programs``), else
    in one."""
    bodies = PackedBodies(self.bodies, packing)

    def packed(body: Body, donates: tuple[str, ...]) -> PackedProgram:
      return PackedProgram(packing, Program(body, donates, self.donate))

    accumulate = packed(bodies.accumulate, ACCUMULATE_DONATES)
    if self.mode == "scan":
      return Pair(accumulate, packed(bodies.scan, UPDATE_DONATES))
    merged = packed(bodies.update, UPDATE_DONATES)
    platform = self._platforms.get(packing, jax.default_backend())
    if not _backend.of(platform).two_programs:
      return Pair(accumulate, merged)
    ending = packed(bodies.ending, UPDATE_DONATES)
    return Pair(accumulate, Split(accumulate, ending, merged))


def _split_over(param: Any) -> tuple[str, ...]:
  """The mesh axes ``param`` is split over."""
  sharding = getattr(param, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return ()
  return tuple(a for entry in sharding.spec for a in _checks.axes(entry))


def avals(tree: Any) -> tuple[Any, ...]:
  """What a jit cache sees of ``tree``: structure, shapes, dtypes, shardings."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(
    (jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves
  )


def _stacked_like(optimizer: MultiSteps, params: Any, layout: DataLayout) -> Any:
  """Shapes of the accumulator in ``layout`` (per-replica partial sums)."""
  config = optimizer.config
  names = config.terms

  def sums(params: Any) -> Any:
    window = _terms.empty(params, config.accumulator_dtype, names)
    return _terms.joined(window, names).acc_grads

  trees = _terms.per_term(jax.eval_shape(sums, params), names)

  def stacked(a: Any, p: Any) -> jax.ShapeDtypeStruct:
    spec = tuple(p.sharding.spec) + (None,) * (jnp.ndim(p) - len(p.sharding.spec))
    sharding = NamedSharding(layout.mesh, layout.spec(*spec))
    return jax.ShapeDtypeStruct((layout.replicas, *a.shape), a.dtype, sharding=sharding)

  return _terms.stored(
    tuple(jax.tree.map(stacked, tree, params) for tree in trees), names
  )

"""Where a train step's accumulator lives for a call, and the programs for it.

One sum, in the programs the step builds first, packed where the model has
many small leaves (:mod:`optax_accum._step._packing`); or per-replica partial sums
(:class:`optax_accum._step._replicas.DataLayout`) under plain ``jit``: added in a
``shard_map`` with ``axis_name`` (:mod:`optax_accum._step._replicas`), or in the
global view with gradients left ``unreduced`` on an ``Explicit`` mesh
(:mod:`optax_accum._step._deferred`). The host chooses for a state the step did not
return last; the programs for each layout are built once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from optax_accum._core import _reduction, _terms
from optax_accum._core._multi_steps import MultiSteps, MultiStepsState
from optax_accum._step import _deferred, _packing
from optax_accum._step._packing import (
  PackedBodies,
  PackedProgram,
  PackedUpdate,
  Packing,
  Recent,
)
from optax_accum._step._programs import Bodies, counters
from optax_accum._step._replicas import (
  DataLayout,
  as_returned,
  data_layout,
  has_partial_sums,
  mesh_of,
  per_replica,
  sharded_programs,
  summed,
)
from optax_accum._step._signature import (
  ACCUMULATE_DONATES,
  UPDATE_DONATES,
  Body,
  Inputs,
  Pair,
  Program,
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

  def arranged(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any = None
  ) -> tuple[Any, MultiStepsState, Layout]:
    """Params and ``opt_state`` as this call runs with them: placed as the
    programs return them (see :func:`as_returned`), the accumulator in this
    call's layout.

    Under plain ``jit`` (concrete arrays: not inside ``shard_map``) with
    ``axis_name``, or with a batch split over ``Explicit`` data axes, the
    accumulator holds per-replica partial sums; anywhere else one sum, packed
    on one device. Called for a state the step did not return last (and in
    scan mode on every call).
    """
    if is_traced(params, opt_state, batch):
      return params, self._summed(params, self._unpacked(params, opt_state)), None
    mesh = mesh_of(params, batch)
    packing = None if mesh is not None else self._packing_of(params)
    if packing is not None:
      return params, self._packed(params, opt_state, packing), packing
    opt_state = self._unpacked(params, opt_state)
    if mesh is not None:
      params, opt_state = as_returned((params, opt_state), mesh)
    config = self.bodies.config
    layout: DataLayout | None
    if config.axis_name is not None:
      scan = self.mode == "scan"
      layout = data_layout(config.axis_name, params, batch, scan=scan)
    else:
      layout = self._deferred_layout(params, opt_state, batch, rng)
    if layout is None:
      return params, self._summed(params, opt_state), None
    accs = [per_replica(acc, params, layout) for acc in self._accumulators(opt_state)]
    return params, self._rebuilt(opt_state, accs), layout

  def on_one_sum(self, params: Any, inner: Any, batch: Any) -> bool:
    """Whether a call starting an empty window runs on one sum, unpacked, in
    the programs of ``one_sum``: traced, or on one device without
    ``axis_name``. (A state without sums has nothing to pack.)"""
    if is_traced(params, inner, batch):
      return True
    return mesh_of(params, batch) is None and self._on_one_device(params)

  def _accumulators(self, opt_state: MultiStepsState) -> tuple[Any, ...]:
    """The state's accumulators, one per loss term."""
    return _terms.per_term(opt_state.acc_grads, self.bodies.config.terms)

  def _rebuilt(self, opt_state: MultiStepsState, accs: Any) -> MultiStepsState:
    return opt_state._replace(acc_grads=_terms.stored(accs, self.bodies.config.terms))

  def _summed(self, params: Any, opt_state: MultiStepsState) -> MultiStepsState:
    """``opt_state`` (unpacked) with one sum: per-replica partial sums added
    up."""
    accs = self._accumulators(opt_state)
    if not any(has_partial_sums(acc, params) for acc in accs):
      return opt_state
    return self._rebuilt(opt_state, [summed(acc, params) for acc in accs])

  def _packing(self, params: Any) -> Packing | None:
    """The packing of the accumulator for ``params``, if it has one: none
    with loss terms (each term its own sums) or ``should_skip_update_fn``
    (which gets the gradient laid out as the params)."""
    config = self.bodies.config
    if config.terms is not None or config.should_skip_update_fn is not None:
      return None
    key = avals(params)
    if key not in self._packings:
      shapes = jax.eval_shape(self.bodies.optimizer.init, params).acc_grads
      self._packings[key] = _packing.plan(shapes, params)
    return self._packings[key]

  def _unpacked(self, params: Any, opt_state: MultiStepsState) -> MultiStepsState:
    """``opt_state`` with its accumulator unpacked, if it was packed."""
    packing = self._packing(params)
    if packing is None or not _packing.is_packed(opt_state.acc_grads, packing):
      return opt_state
    return opt_state._replace(acc_grads=_packing.unpack(opt_state.acc_grads, packing))

  def _packing_of(self, params: Any) -> Packing | None:
    """The packing a call on no mesh, outside the user's ``jit``, runs with:
    on one device without ``axis_name``; else ``None``."""
    return self._packing(params) if self._on_one_device(params) else None

  def _on_one_device(self, params: Any) -> bool:
    """Whether params (on no mesh) are on one device, without ``axis_name``."""
    no_axis = self.bodies.config.axis_name is None
    return no_axis and len(_devices(params)) <= 1

  def _packed(
    self, params: Any, opt_state: MultiStepsState, packing: Packing
  ) -> MultiStepsState:
    """``opt_state`` with one sum in ``packing``'s layout (kept if it is)."""
    if _packing.is_packed(opt_state.acc_grads, packing):
      return opt_state
    state = self._summed(params, opt_state)
    return state._replace(acc_grads=_packing.pack(state.acc_grads, packing))

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

      self._chosen[key] = _deferred.choose_leaves(layout, fits, params)
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
      self._built[layout] = built
    return self._built[layout]

  def _packed_programs(self, packing: Packing) -> Pair:
    """The programs on a packed accumulator (one sum)."""
    recent, bodies = Recent(packing), PackedBodies(self.bodies, packing)

    def packed(body: Body, donates: tuple[str, ...]) -> PackedProgram:
      return PackedProgram(recent, Program(body, donates, self.donate))

    accumulate = packed(bodies.accumulate, ACCUMULATE_DONATES)
    if self.mode == "scan":
      return Pair(accumulate, packed(bodies.scan, UPDATE_DONATES))
    ending = packed(bodies.ending, UPDATE_DONATES)
    merged = packed(bodies.update, UPDATE_DONATES)
    return Pair(accumulate, PackedUpdate(accumulate, ending, merged))


def _devices(tree: Any) -> set[Any]:
  """The devices ``tree``'s arrays are on (host arrays are on none)."""
  return {
    d for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()
  }


def avals(tree: Any) -> tuple[Any, ...]:
  """What a jit cache sees of ``tree``: structure, shapes, dtypes, shardings."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(
    (jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves
  )


def _stacked_like(optimizer: MultiSteps, params: Any, layout: DataLayout) -> Any:
  """Shapes of the accumulator in ``layout`` (per-replica partial sums)."""
  names = optimizer.config.terms
  trees = _terms.per_term(jax.eval_shape(optimizer.init, params).acc_grads, names)

  def stacked(a: Any, p: Any) -> jax.ShapeDtypeStruct:
    spec = tuple(p.sharding.spec) + (None,) * (jnp.ndim(p) - len(p.sharding.spec))
    sharding = NamedSharding(layout.mesh, layout.spec(*spec))
    return jax.ShapeDtypeStruct((layout.replicas, *a.shape), a.dtype, sharding=sharding)

  return _terms.stored(
    tuple(jax.tree.map(stacked, tree, params) for tree in trees), names
  )

"""A train step's host side: which accumulator layout a call runs in (the init
chooses it, the step keeps it: :class:`Layouts`), each layout's programs, built
once, and what the host knows of the state a step returned last
(:class:`Known`), so a streaming call picks its program without waiting for
the device; any other state (the first, a restored one, one from
``relayout`` or ``_replace``) is read and laid out again."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._core import _checks
from optax_accum._core._multi_steps import MultiSteps
from optax_accum._core._placement import as_returned, mesh_of, traced
from optax_accum._layouts import (
  ONE_SUM,
  Layout,
  choose_leaves,
  for_call,
  inside,
  kept,
  per_replica_like,
  unstacked,
)
from optax_accum._step._programs import Bodies, Inputs, Pair, State, counters, programs


class Layouts:
  """A train step's layouts: the one each call runs in, chosen once for a state
  the step did not return, and each one's programs, built once."""

  def __init__(self, bodies: Bodies, mode: str, donate: bool):
    self.bodies = bodies
    self.scan = mode == "scan"
    self.donate = donate
    self._replica_axes = _checks.axes(bodies.config.axis_name)  # () for none.
    self._built: dict[Layout, Pair] = {}
    self._chosen: dict[Any, Layout] = {}

  def arranged(
    self, params: Any, state: State, batch: Any, rng: Any = None, keep: bool = True
  ) -> tuple[Any, State, Layout]:
    """Params, ``state`` in the call's layout and placed as the programs
    return them, and that layout: the state's own where it keeps one
    (``keep``: one sum stays one sum, on any devices; ``_layouts.kept``), else
    the call's devices' (``_layouts.for_call``; one sum if traced: its result
    goes back to the given layout, ``_layouts.carried``). With ``axis_name``
    under plain ``jit`` the programs run in a ``shard_map``, which takes only
    per-replica partial sums."""
    in_trace = traced(params, state, batch)
    layout = kept(state.acc_grads) if keep else None
    if not in_trace and (layout is None or self._replica_axes):  # The devices'.
      params, state = as_returned((params, state), (params, batch))
      layout = self._data_layout(params, state, batch, rng)
    layout = layout or ONE_SUM
    state = self.lay_out(state, layout, params)
    if in_trace:
      return params, state, layout
    return (*as_returned((params, state), (params, batch)), layout)

  def lay_out(self, state: State, layout: Layout, params: Any = None) -> State:
    """``state`` with its accumulator in ``layout`` (kept if it is)."""
    acc = layout.store(state.acc_grads, params, self.bodies.config.terms)
    return state._replace(acc_grads=acc)

  def _data_layout(
    self, params: Any, opt_state: State, batch: Any, rng: Any
  ) -> Layout | None:
    """The per-replica layout of a call on a mesh, if it has one; a deferred
    one's leaves chosen once per avals."""
    config = self.bodies.config

    def choose(mesh: Any, axes: tuple[str, ...]) -> Layout:
      key = (mesh, axes, *map(avals, (params, batch)), rng is None)
      if key not in self._chosen:
        sums = jax.eval_shape(self.bodies.optimizer.init, params).acc_grads
        acc = inside(per_replica_like(mesh, axes, sums, params, config.terms))
        micro_batch = jax.tree.map(unstacked, batch) if self.scan else batch
        inputs = Inputs(params, None, acc, counters(opt_state), micro_batch, rng)

        def fits(chosen: Layout) -> bool:
          body = chosen.wrap(self.bodies.under(chosen.reduction).accumulate, False)
          try:
            jax.eval_shape(body, inputs)
          except Exception:  # A cast JAX has no rule for (or a loss that fails
            return False  # anyway: with nothing cast, the call raises it).
          return True

        self._chosen[key] = choose_leaves(mesh, axes, fits, params)
      return self._chosen[key]

    return for_call(params, batch, config, scan=self.scan, choose=choose)

  def on_one_sum(self, params: Any, inner: Any, batch: Any) -> bool:
    """Whether an empty-window call runs on one sum: traced or no mesh."""
    in_trace = traced(params, inner, batch)
    return in_trace or (mesh_of(params, batch) is None and not self._replica_axes)

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


def _host_int(x: jax.Array) -> int:
  """A replicated scalar's value, read from this process's own copy."""
  if getattr(x, "is_fully_addressable", True):
    return int(jax.device_get(x))
  return int(np.asarray(x.addressable_shards[0].data))


UNKNOWN: Any = object()  # A learning rate not looked up yet.


class Known(NamedTuple):
  """What the host knows about the optimizer state a step returned last."""

  mini_step: jax.Array  # The returned state's counters, compared by identity.
  gradient_step: jax.Array
  value: int | None = None  # Its value; None where counting depends on the data.
  k: int | None = None  # The window's length; None where it must be read.
  params: Any = None  # Params the update program returned: fresh, unaliased buffers.
  learning_rate: Any = UNKNOWN  # The metric (unchanged until the next update).
  layout: Layout = ONE_SUM  # The layout of the state returned.
  acc: Any = None  # The returned state's accumulator node, compared by identity.

  def returned(self, state: Any) -> bool:
    """Whether ``state`` is the one returned last: its very counter and acc
    objects (so a :class:`MultiStepsState`, checked and on the host)."""
    return (
      getattr(state, "mini_step", None) is self.mini_step
      and state.gradient_step is self.gradient_step
      and state.acc_grads is self.acc
    )

  def counts(self, state: State, optimizer: MultiSteps) -> tuple[int, int]:
    """The window's micro-batches so far and length, read from ``state`` if unknown."""
    value = _host_int(state.mini_step) if self.value is None else self.value
    k = self.k if self.k is not None else optimizer.config.constant_k
    if k is None:
      k = int(optimizer.k_at(_host_int(state.gradient_step)))
    return value, max(k, 1)

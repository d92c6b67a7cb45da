"""The one signature of a train step's programs: every program (accumulate,
update, scan, ending) in every accumulator layout maps :class:`Inputs` to
:class:`Outputs`; a layout changes fields (``acc``, ``aux``), never positions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from optax_accum._core._backend import compiler_options
from optax_accum._layouts import Sharded, renamed


class Inputs(NamedTuple):
  """A program's inputs (or anything laid out like them: their specs)."""

  params: Any
  inner: Any  # The inner optimizer's state; ``None`` for accumulate.
  acc: Any  # The window's sums, in the call's layout.
  counters: Any  # The state without params-sized parts; never donated.
  batch: Any  # The micro-batch (scan mode: the window's).
  rng: Any  # The run's key, or ``None``.
  end_window: Any = None  # Whether the caller ends the window (streaming update).


class Outputs(NamedTuple):
  """A program's outputs, ``metrics`` without ``aux``; accumulate's have ``None``
  params and inner, and only ``loss`` and ``grad_norm`` as metrics."""

  params: Any
  inner: Any
  acc: Any
  counters: Any
  metrics: Any
  aux: Any


Body = Callable[[Inputs], Outputs]

#: The fields each program donates: those it returns, updated in place.
ACCUMULATE_DONATES = ("acc",)
UPDATE_DONATES = ("params", "inner", "acc")


class Program:
  """``body`` jitted field by field, so ``donates`` can be donated, in the
  ``shard_map`` of ``sharded`` where it has one. Built in ``compiled_with``,
  it compiles with those XLA options when called from Python (JAX honours
  them on a top-level jit only)."""

  def __init__(
    self,
    body: Body,
    donates: tuple[str, ...],
    donate: bool,
    sharded: Sharded | None = None,
  ):
    def flat(*fields: Any) -> Outputs:
      return body(Inputs(*fields))

    renamed(flat, body)  # What jit logs and profiles.

    argnums = tuple(Inputs._fields.index(name) for name in donates) if donate else ()
    fn = flat if sharded is None else _mapped(flat, sharded)
    self.nested = jax.jit(fn, donate_argnums=argnums)
    options = compiler_options()
    self.jitted = (
      self.nested
      if options is None
      else jax.jit(fn, donate_argnums=argnums, compiler_options=options)
    )

  def __call__(self, inputs: Inputs) -> Outputs:
    if self.jitted is not self.nested and _traced(inputs):  # Options: no walk.
      return Outputs(*self.nested(*inputs))
    return Outputs(*self.jitted(*inputs))

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.jitted.lower(*inputs)


def _traced(inputs: Inputs) -> bool:
  """Whether a call is traced: a tracer among counters, first param, first batch."""
  firsts = [jax.tree.leaves(tree)[:1] for tree in (inputs.params, inputs.batch)]
  probe = [*jax.tree.leaves(inputs.counters), *firsts[0], *firsts[1]]
  return any(isinstance(x, jax.core.Tracer) for x in probe)


def _mapped(flat: Callable[..., Outputs], sharded: Sharded) -> Callable[..., Outputs]:
  """``flat`` in a ``shard_map`` splitting the accumulator, rows and ``aux`` as
  ``sharded`` says; everything else whole."""
  whole = P()
  inputs = Inputs(whole, whole, sharded.acc, whole, sharded.rows, whole, whole)
  outputs = Outputs(whole, whole, sharded.acc, whole, whole, sharded.aux)
  return jax.shard_map(
    flat,
    mesh=sharded.mesh,
    in_specs=tuple(inputs),
    out_specs=outputs,
    axis_names=set(sharded.axes),
  )


class Pair(NamedTuple):
  """A layout's ``accumulate`` and ``update`` (may end the window) programs."""

  accumulate: Any
  update: Any


class Split:
  """The update program run as ``accumulate`` then ``ending``: on XLA:CPU, where
  a dispatch costs as much as the work, faster, and the gradient compiles once.
  :meth:`lower` gives ``merged`` (one program), whose peak bounds each's."""

  def __init__(self, accumulate: Any, ending: Any, merged: Any):
    self.accumulate, self.ending, self.merged = accumulate, ending, merged

  def __call__(self, inputs: Inputs) -> Outputs:
    added = self.accumulate(inputs._replace(inner=None, end_window=None))
    ends = inputs._replace(acc=added.acc, counters=added.counters, batch=None)
    return self.ending(ends._replace(rng=None))._replace(aux=added.aux)

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.merged.lower(inputs)

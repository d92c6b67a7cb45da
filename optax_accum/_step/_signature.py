"""The one signature of a train step's programs: what each takes and returns.

Every program (accumulate, update, scan, ending) and every layout of the
accumulator (one sum, packed, per replica, deferred) maps :class:`Inputs` to
:class:`Outputs`; a layout changes fields (``acc``, ``aux``), never positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from optax_accum._core._backend import compiler_options


class Inputs(NamedTuple):
  """A program's inputs (or anything laid out like them: their specs).

  Attributes:
    params: The params.
    inner: The inner optimizer's state (``None`` for the accumulate program,
      which never reads it).
    acc: The window's sums, in the call's layout.
    counters: The ``MultiStepsState`` without its params-sized parts (see
      :func:`~optax_accum._step._programs.counters`); never donated.
    batch: The micro-batch (scan mode: the window's micro-batches).
    rng: The run's key, or ``None``.
    end_window: Whether the caller ends the window (streaming update only).
  """

  params: Any
  inner: Any
  acc: Any
  counters: Any
  batch: Any
  rng: Any
  end_window: Any = None


class Outputs(NamedTuple):
  """A program's outputs: ``params`` and ``inner`` are ``None`` from the
  accumulate program, which returns neither; ``metrics`` are the step's (the
  accumulate program's: ``loss`` and ``grad_norm``), without ``aux``."""

  params: Any
  inner: Any
  acc: Any
  counters: Any
  metrics: Any
  aux: Any


Body = Callable[[Inputs], Outputs]

#: The fields each program donates: params and the inner state are updated in
#: place by the programs that return them; the accumulator by both.
ACCUMULATE_DONATES = ("acc",)
UPDATE_DONATES = ("params", "inner", "acc")


class Program:
  """``body`` jitted, its inputs passed field by field so that ``donates``
  (field names) can be donated; ``mapped`` wraps the flat function first
  (a ``shard_map``). Built in a ``compiled_with`` block, it compiles with
  those XLA options when called from Python (JAX takes them on a top-level
  ``jit`` only: traced in another, it is that program's part)."""

  def __init__(
    self,
    body: Body,
    donates: tuple[str, ...],
    donate: bool,
    mapped: Callable[[Callable[..., Outputs]], Callable[..., Outputs]] | None = None,
  ):
    def flat(*fields: Any) -> Outputs:
      return body(Inputs(*fields))

    renamed(flat, body)  # What jit logs and profiles.

    argnums = tuple(Inputs._fields.index(name) for name in donates) if donate else ()
    fn = flat if mapped is None else mapped(flat)
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
  """Whether a call is traced in another program: its counters, first param
  or first batch leaf is a tracer (no walk over every leaf)."""
  firsts = [jax.tree.leaves(tree)[:1] for tree in (inputs.params, inputs.batch)]
  probe = [*jax.tree.leaves(inputs.counters), *firsts[0], *firsts[1]]
  return any(isinstance(x, jax.core.Tracer) for x in probe)


def renamed(wrapper: Body, body: Body) -> Body:
  """``wrapper`` named as ``body`` (through the layouts' wrappers), whose
  program it builds."""
  wrapper.__name__ = wrapper.__qualname__ = getattr(body, "__name__", "program")
  return wrapper


class Pair(NamedTuple):
  """A layout's two programs: ``accumulate`` for a micro-step that cannot end
  the window, ``update`` for one that can (scan mode: the whole window)."""

  accumulate: Any
  update: Any


class Split:
  """The update program run as two: ``accumulate`` adds the micro-batch,
  ``ending`` ends the window (the backend's ``two_programs``: on XLA:CPU,
  where a dispatch weighs as much as the work, faster than one program, and
  the micro-batch's gradient is compiled once, in ``accumulate``, where one
  program would compile it again). ``merged`` (the update body as one
  program) is what :meth:`lower` gives for XLA's analyses: its peak memory
  bounds each of the two's.
  """

  def __init__(self, accumulate: Any, ending: Any, merged: Any):
    self.accumulate, self.ending, self.merged = accumulate, ending, merged

  def __call__(self, inputs: Inputs) -> Outputs:
    added = self.accumulate(inputs._replace(inner=None, end_window=None))
    ends = inputs._replace(acc=added.acc, counters=added.counters, batch=None)
    return self.ending(ends._replace(rng=None))._replace(aux=added.aux)

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.merged.lower(inputs)

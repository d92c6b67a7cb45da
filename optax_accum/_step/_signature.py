"""The one signature of a train step's programs: every program (accumulate,
update, scan, ending) in every accumulator layout maps :class:`Inputs` to
:class:`Outputs`; a layout changes fields (``acc``, ``aux``), never positions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from optax_accum._core._backend import compiler_options


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
  """``body`` jitted field by field, so ``donates`` can be donated; ``mapped``
  wraps it first. Built in ``compiled_with``, it compiles with those XLA
  options when called from Python (JAX honours them on a top-level jit only)."""

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
  """Whether a call is traced: a tracer among counters, first param, first batch."""
  firsts = [jax.tree.leaves(tree)[:1] for tree in (inputs.params, inputs.batch)]
  probe = [*jax.tree.leaves(inputs.counters), *firsts[0], *firsts[1]]
  return any(isinstance(x, jax.core.Tracer) for x in probe)


def renamed(wrapper: Body, body: Body) -> Body:
  """``wrapper`` named as ``body``, whose program it builds."""
  wrapper.__name__ = wrapper.__qualname__ = getattr(body, "__name__", "program")
  return wrapper


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

"""The Layout protocol, one class per accumulator layout (:class:`OneSum` here;
``_replicas``, ``_deferred``), and :func:`programs`, which builds
any layout's programs (docs/development.md lists the layouts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from optax_accum._core import _backend, _layout
from optax_accum._core._state import MultiStepsState
from optax_accum._core._terms import Names
from optax_accum._step._signature import (
  ACCUMULATE_DONATES,
  UPDATE_DONATES,
  Body,
  Inputs,
  Outputs,
  Pair,
  Program,
  Split,
)

if TYPE_CHECKING:
  from optax_accum._step._programs import Bodies

Mapped = Callable[[Callable[..., Outputs]], Callable[..., Outputs]]


class Layout:
  """An accumulator layout; the defaults are the one sum's (no ``shard_map``)."""

  converts: ClassVar[bool] = False  # Programs take it converted (inside/outside).

  def stored(
    self, state: MultiStepsState, params: Any = None, terms: Names = None
  ) -> MultiStepsState:
    """``state``'s accumulator (any layout) in this one; partial sums added up."""
    return state._replace(acc_grads=_layout.one_sum(state.acc_grads))

  def empty(
    self, state: MultiStepsState, params: Any = None, terms: Names = None
  ) -> MultiStepsState:
    """``opt.init``'s state (an empty window) in this layout."""
    return self.stored(state, params, terms)

  def bodies(self, bodies: Bodies) -> Bodies:
    """The bodies for this layout (its reduction policy, its gradient layout)."""
    return bodies

  def body(self, body: Body, window: bool) -> Body:
    """``body`` on the accumulator as the program takes it (``window``: the
    body takes a whole window, its ``aux`` stacked along the first axis)."""
    return body

  def mapped(self, window: bool) -> Mapped | None:
    """The ``shard_map`` a program runs in, or ``None``."""
    return None

  def inside(self, acc: Any) -> Any:
    """The stored accumulator as the program takes it."""
    return acc

  def outside(self, acc: Any) -> Any:
    """The program's accumulator as stored."""
    return acc

  def two_programs(self, bodies: Bodies) -> bool:
    """Whether a streamed window ends in two programs (accumulate, ending)."""
    return False


class OneSum(Layout):
  """The window's sums laid out as the params (one tree per loss term)."""

  def two_programs(self, bodies: Bodies) -> bool:
    if bodies.config.should_skip_update_fn is not None:
      return False
    return _backend.of(jax.default_backend()).two_programs


ONE_SUM = OneSum()


class Bound:
  """A program called and lowered with the accumulator as ``layout`` stores it."""

  def __init__(self, layout: Layout, program: Program):
    self.layout, self.program = layout, program

  def _in(self, inputs: Inputs) -> Inputs:
    return inputs._replace(acc=self.layout.inside(inputs.acc))

  def __call__(self, inputs: Inputs) -> Outputs:
    out = self.program(self._in(inputs))
    return out._replace(acc=self.layout.outside(out.acc))

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.program.lower(self._in(inputs))


def programs(layout: Layout, bodies: Bodies, *, scan: bool, donate: bool) -> Pair:
  """``bodies``' accumulate and update programs for ``layout`` (scan: the window's)."""
  bodies = layout.bodies(bodies)

  def program(body: Body, donates: tuple[str, ...], window: bool = False) -> Any:
    built = Program(layout.body(body, window), donates, donate, layout.mapped(window))
    return Bound(layout, built) if layout.converts else built

  accumulate = program(bodies.accumulate, ACCUMULATE_DONATES)
  update = program(bodies.scan if scan else bodies.update, UPDATE_DONATES, window=scan)
  if not scan and layout.two_programs(bodies):
    update = Split(accumulate, program(bodies.ending, UPDATE_DONATES), update)
  return Pair(accumulate, update)

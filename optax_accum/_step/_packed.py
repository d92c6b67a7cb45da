"""The packed layout (:class:`optax_accum._core._layout.Packed`): small leaves'
sums in shared buffers, on one device.

Every buffer a program takes or returns costs the host time on every call,
whatever its size, and XLA:CPU runs a kernel per leaf for each small add. On a
model of many small leaves (an unscanned transformer's norms and biases, or
hundreds of small layers) ``step.init(params)`` packs the sums
(:func:`optax_accum._core._layout.packing_for`), and the step passes one
buffer per group of small leaves of one dtype. Inside the programs
(:class:`PackedBodies`) each micro-batch's gradients are packed alike and
added to a group in one pass; the optimizer gets the sums cut back into
leaves. The arithmetic is the same element by element, so every result is
bit-identical to the one-sum layout's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from optax_accum._core import _backend, _layout
from optax_accum._core._layout import Packed, Packing
from optax_accum._core._state import MultiStepsState
from optax_accum._core._terms import Names
from optax_accum._step._layout import Layout
from optax_accum._step._programs import Bodies


@dataclasses.dataclass(frozen=True)
class PackedLayout(Layout):
  """Sums packed as ``packing`` says; ``platform``: where the params live
  (its backend says whether a streamed window ends in two programs)."""

  packing: Packing
  platform: str
  converts: ClassVar[bool] = True

  def stored(
    self, state: MultiStepsState, params: Any = None, terms: Names = None
  ) -> MultiStepsState:
    acc = state.acc_grads
    if isinstance(acc, Packed) and acc.packing == self.packing:
      return state
    return state._replace(acc_grads=_layout.pack(_layout.one_sum(acc), self.packing))

  def bodies(self, bodies: Bodies) -> Bodies:
    return PackedBodies(bodies, self.packing)

  def inside(self, acc: Packed) -> Any:
    return acc.groups, acc.rest

  def outside(self, acc: Any) -> Packed:
    groups, rest = acc
    return Packed(tuple(groups), tuple(rest), self.packing)

  def two_programs(self, bodies: Bodies) -> bool:
    return _backend.of(self.platform).two_programs


class PackedBodies(Bodies):
  """The train step's bodies with the accumulator packed inside the program
  (one concatenation per group for each micro-batch's gradient)."""

  def __init__(self, bodies: Bodies, packing: Packing):
    super().__init__(bodies.loss_fn, bodies.optimizer, bodies.has_aux, bodies.reduction)
    self.packing = packing

  def accumulated(self, grads: Any) -> Any:
    laid_out = _layout.packed_like(grads, self.packing, name="params")
    return laid_out.groups, laid_out.rest

  def as_params(self, acc: Any) -> Any:
    return _layout.unpacked(self.packing, *acc)

"""The programs on a packed accumulator (:class:`optax_accum._core._layout.Packed`).

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

from typing import Any

import jax

from optax_accum._core import _layout
from optax_accum._core._layout import Packed, Packing
from optax_accum._step._programs import Bodies
from optax_accum._step._signature import Inputs, Outputs, Program


class PackedBodies(Bodies):
  """The train step's bodies with the accumulator packed inside the program.

  Each micro-batch's gradient is packed as the sums are (one concatenation
  per group) and added to them in one pass over each buffer, as to a
  contiguous accumulator; the optimizer gets the sums cut back into leaves.
  The arithmetic is the same, element by element.
  """

  def __init__(self, bodies: Bodies, packing: Packing):
    super().__init__(bodies.loss_fn, bodies.optimizer, bodies.has_aux, bodies.reduction)
    self.packing = packing

  def accumulated(self, grads: Any) -> Any:
    laid_out = _layout.packed_like(grads, self.packing, name="params")
    return laid_out.groups, laid_out.rest

  def as_params(self, acc: Any) -> Any:
    return _layout.unpacked(self.packing, *acc)


class PackedProgram:
  """A :class:`Program` of :class:`PackedBodies`' bodies, called with a
  :class:`Packed` accumulator: the program takes its group buffers and
  other leaves, and the result comes back as a :class:`Packed` of the same
  packing (also traced, inside the user's ``jit`` or ``scan``)."""

  def __init__(self, packing: Packing, program: Program):
    self.packing, self.program = packing, program

  def _split(self, inputs: Inputs) -> Inputs:
    acc = inputs.acc
    return inputs._replace(acc=(acc.groups, acc.rest))

  def __call__(self, inputs: Inputs) -> Outputs:
    out = self.program(self._split(inputs))
    groups, rest = out.acc
    return out._replace(acc=Packed(tuple(groups), tuple(rest), self.packing))

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.program.lower(self._split(inputs))

"""The packed layout (:class:`optax_accum._core._layout.Packed`): small leaves'
sums in shared buffers, on one device. Each buffer a program passes costs host
time per call, and XLA:CPU runs a kernel per leaf for each small add; so with
many small leaves ``step.init`` packs the sums, one buffer per dtype group, and
each micro-batch's gradient is packed alike. Same arithmetic: bit-identical.
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
  """Sums packed by ``packing``; ``platform``'s backend decides ``two_programs``."""

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

  def empty(
    self, state: MultiStepsState, params: Any = None, terms: Names = None
  ) -> MultiStepsState:
    return state._replace(acc_grads=_layout.packed_zeros(state.acc_grads, self.packing))

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
  """Bodies that pack each micro-batch's gradient (a concatenation per group)."""

  def __init__(self, bodies: Bodies, packing: Packing):
    super().__init__(bodies.loss_fn, bodies.optimizer, bodies.has_aux, bodies.reduction)
    self.packing = packing

  def accumulated(self, grads: Any) -> Any:
    laid_out = _layout.packed_like(grads, self.packing, name="params")
    return laid_out.groups, laid_out.rest

  def as_params(self, acc: Any) -> Any:
    return _layout.unpacked(self.packing, *acc)

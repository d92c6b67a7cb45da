"""What the host knows of the state a step returned last, so a streaming call
picks its program without waiting for the device; any other state (the first, a
restored one, one from ``relayout`` or ``_replace``) is read and laid out again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum._core._multi_steps import MultiSteps, MultiStepsState
from optax_accum._step._one_sum import ONE_SUM, Layout


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
  value: int | None  # Its value; None where counting depends on the data.
  k: int | None  # The window's length; None where it must be read.
  params: Any  # Params the update program returned: fresh, unaliased buffers.
  learning_rate: Any  # The metric (unchanged until the next update), or UNKNOWN.
  layout: Layout = ONE_SUM  # The layout of the state returned.
  acc: Any = None  # The returned state's accumulator node, compared by identity.

  def describes(self, state: MultiStepsState) -> bool:
    """Whether ``state`` is the one returned last: its very counter and acc objects."""
    return (
      state.mini_step is self.mini_step
      and state.gradient_step is self.gradient_step
      and state.acc_grads is self.acc
    )

  def counts(self, state: MultiStepsState, optimizer: MultiSteps) -> tuple[int, int]:
    """The window's micro-batches so far and length, read from ``state`` if unknown."""
    value = _host_int(state.mini_step) if self.value is None else self.value
    k = self.k if self.k is not None else optimizer.config.constant_k
    if k is None:
      k = int(optimizer.k_at(_host_int(state.gradient_step)))
    return value, max(k, 1)

"""One sum: the window's sums laid out as the params (one tree per loss term).

What ``opt.init(params)`` gives and ``MultiSteps.update`` takes; the protocol's
defaults (:class:`~optax_accum._layouts._protocol.Layout`) are its answers, but
for whether a streamed window ends in two programs (a backend's choice).
"""

from __future__ import annotations

import jax

from optax_accum._core import _backend
from optax_accum._core._state import MultiStepsConfig
from optax_accum._layouts._protocol import Layout


class OneSum(Layout):
  """The window's sums laid out as the params."""

  def two_programs(self, config: MultiStepsConfig) -> bool:
    if config.should_skip_update_fn is not None:
      return False
    return _backend.of(jax.default_backend()).two_programs


ONE_SUM = OneSum()

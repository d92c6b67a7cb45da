"""Flax integration: import explicitly (``import optax_accum.flax``); needs flax.

- :class:`TrainState`: Linen's ``TrainState`` whose ``apply_gradients`` takes
  ``weight=`` and whose ``step`` counts updates.
- :class:`Optimizer`: ``nnx.Optimizer`` whose ``update`` requires ``weight=``
  and whose ``step`` counts updates.
"""

from optax_accum._frameworks._linen import TrainState
from optax_accum._frameworks._nnx import Optimizer

__all__ = ("Optimizer", "TrainState")

"""Flax integration: import explicitly (``import optax_accum.flax``); needs flax.

- :class:`TrainState`: Linen's ``TrainState`` whose ``apply_gradients`` takes
  ``weight=`` and whose ``step`` counts updates.
- :class:`Optimizer`: ``nnx.Optimizer`` whose ``update`` requires ``weight=``
  and whose ``step`` counts updates.

Both also take a plain optax optimizer (no accumulation, ``k = 1``) and then
train bit for bit as Flax's own, ``weight=`` accepted (a bad one drops the
micro-batch, as ``MultiSteps(tx, 1)`` does).
"""

from optax_accum._frameworks._linen import TrainState
from optax_accum._frameworks._nnx import Optimizer

__all__ = ("Optimizer", "TrainState")

"""Gradient accumulation for JAX/Optax, exactly equivalent to the whole batch."""

from optax_accum._multi_steps import (
  WINDOW_MICRO_STEPS,
  WINDOW_WEIGHT,
  MultiSteps,
  MultiStepsState,
)

__version__ = "0.1.0"

__all__ = (
  "WINDOW_MICRO_STEPS",
  "WINDOW_WEIGHT",
  "MultiSteps",
  "MultiStepsState",
  "__version__",
)

"""Gradient accumulation for JAX/Optax, exactly equivalent to the whole batch."""

from optax_accum._inspect import get_hyperparams, get_update_count
from optax_accum._multi_steps import (
  WINDOW_MICRO_STEPS,
  WINDOW_WEIGHT,
  MultiSteps,
  MultiStepsState,
)
from optax_accum._schedules import ProgressSchedule, ProgressState, progress_schedule

__version__ = "0.1.0"

__all__ = (
  "WINDOW_MICRO_STEPS",
  "WINDOW_WEIGHT",
  "MultiSteps",
  "MultiStepsState",
  "ProgressSchedule",
  "ProgressState",
  "__version__",
  "get_hyperparams",
  "get_update_count",
  "progress_schedule",
)

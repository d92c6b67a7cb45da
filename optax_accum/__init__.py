"""Gradient accumulation for JAX/Optax, exactly equivalent to the whole batch."""

from optax_accum._audit import AuditReport, Verdict, audit
from optax_accum._batching import causal_lm_target_mask, split_micro_batches
from optax_accum._inspect import (
  get_hyperparams,
  get_last_window,
  get_update_count,
  schedule_free_eval_params,
)
from optax_accum._micro_batch_plan import MicroBatchPlan
from optax_accum._multi_steps import (
  WINDOW_MICRO_STEPS,
  WINDOW_WEIGHT,
  MultiSteps,
  MultiStepsConfig,
  MultiStepsState,
)
from optax_accum._optax_microbatch import weighted_mean_accumulator
from optax_accum._planning import plan_micro_batches
from optax_accum._schedules import ProgressSchedule, ProgressState, progress_schedule
from optax_accum._train_step import TrainStep, make_train_step

__version__ = "0.1.0"

__all__ = (
  "WINDOW_MICRO_STEPS",
  "WINDOW_WEIGHT",
  "AuditReport",
  "MicroBatchPlan",
  "MultiSteps",
  "MultiStepsConfig",
  "MultiStepsState",
  "ProgressSchedule",
  "ProgressState",
  "TrainStep",
  "Verdict",
  "__version__",
  "audit",
  "causal_lm_target_mask",
  "get_hyperparams",
  "get_last_window",
  "get_update_count",
  "make_train_step",
  "plan_micro_batches",
  "progress_schedule",
  "schedule_free_eval_params",
  "split_micro_batches",
  "weighted_mean_accumulator",
)

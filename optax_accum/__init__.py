"""Gradient accumulation for JAX/Optax, exactly equivalent to the whole batch."""

from optax_accum._audit import AuditReport, Verdict, audit, per_window
from optax_accum._core._layout import Packed, PerReplica, relayout
from optax_accum._core._multi_steps import (
  WINDOW_MICRO_STEPS,
  WINDOW_WEIGHT,
  MultiSteps,
  MultiStepsConfig,
  MultiStepsState,
)
from optax_accum._core._optax_microbatch import weighted_mean_accumulator
from optax_accum._core._resume import resume_target
from optax_accum._planning import MicroBatchPlan, plan_micro_batches
from optax_accum._progress import (
  ProgressSchedule,
  ProgressState,
  causal_lm_target_mask,
  get_hyperparams,
  get_last_window,
  get_update_count,
  progress_schedule,
  schedule_free_eval_params,
  split_micro_batches,
)
from optax_accum._step import CoupledLoss, TrainStep, make_train_step

__version__ = "0.1.0"

__all__ = (
  "WINDOW_MICRO_STEPS",
  "WINDOW_WEIGHT",
  "AuditReport",
  "CoupledLoss",
  "MicroBatchPlan",
  "MultiSteps",
  "MultiStepsConfig",
  "MultiStepsState",
  "Packed",
  "PerReplica",
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
  "per_window",
  "plan_micro_batches",
  "progress_schedule",
  "relayout",
  "resume_target",
  "schedule_free_eval_params",
  "split_micro_batches",
  "weighted_mean_accumulator",
)

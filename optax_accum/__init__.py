"""Gradient accumulation for JAX/Optax, exactly equivalent to the whole batch."""

from optax_accum._audit import AuditReport, Verdict, audit, per_window
from optax_accum._core._multi_steps import (
  WINDOW_MICRO_STEPS,
  WINDOW_WEIGHT,
  MultiSteps,
  MultiStepsConfig,
  MultiStepsState,
)
from optax_accum._core._noise import NoiseScaleState
from optax_accum._core._optax_microbatch import weighted_mean_accumulator
from optax_accum._layouts import Packed, PerReplica, relayout, resume_target
from optax_accum._planning import MicroBatchPlan, plan_micro_batches
from optax_accum._progress import (
  NoiseScaleEMA,
  ProgressSchedule,
  ProgressState,
  ScaleByAdamInItemsState,
  WindowController,
  WindowControllerState,
  adamw_in_items,
  causal_lm_target_mask,
  get_hyperparams,
  get_last_window,
  get_update_count,
  progress_schedule,
  scale_by_adam_in_items,
  scale_by_window_weight,
  schedule_free_eval_params,
  smooth_noise_scale,
  split_micro_batches,
)
from optax_accum._step import CoupledLoss, TrainStep, make_train_step

__version__ = "0.2.0"

__all__ = (
  "WINDOW_MICRO_STEPS",
  "WINDOW_WEIGHT",
  "AuditReport",
  "CoupledLoss",
  "MicroBatchPlan",
  "MultiSteps",
  "MultiStepsConfig",
  "MultiStepsState",
  "NoiseScaleEMA",
  "NoiseScaleState",
  "Packed",
  "PerReplica",
  "ProgressSchedule",
  "ProgressState",
  "ScaleByAdamInItemsState",
  "TrainStep",
  "Verdict",
  "WindowController",
  "WindowControllerState",
  "__version__",
  "adamw_in_items",
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
  "scale_by_adam_in_items",
  "scale_by_window_weight",
  "schedule_free_eval_params",
  "smooth_noise_scale",
  "split_micro_batches",
  "weighted_mean_accumulator",
)

"""Progress: schedules that count real updates, state inspection, batch helpers.

The wings above import only these names.
"""

from optax_accum._core._hyperparams import get_hyperparams
from optax_accum._progress._batching import causal_lm_target_mask, split_micro_batches
from optax_accum._progress._inspect import (
  get_last_window,
  get_update_count,
  schedule_free_eval_params,
)
from optax_accum._progress._noise_scale import NoiseScaleEMA, smooth_noise_scale
from optax_accum._progress._schedules import (
  ProgressSchedule,
  ProgressState,
  progress_schedule,
)
from optax_accum._progress._window_controller import (
  WindowController,
  WindowControllerState,
)
from optax_accum._progress._window_scaling import (
  ScaleByAdamInItemsState,
  adamw_in_items,
  scale_by_adam_in_items,
  scale_by_window_weight,
)

__all__ = (
  "NoiseScaleEMA",
  "ProgressSchedule",
  "ProgressState",
  "ScaleByAdamInItemsState",
  "WindowController",
  "WindowControllerState",
  "adamw_in_items",
  "causal_lm_target_mask",
  "get_hyperparams",
  "get_last_window",
  "get_update_count",
  "progress_schedule",
  "scale_by_adam_in_items",
  "scale_by_window_weight",
  "schedule_free_eval_params",
  "smooth_noise_scale",
  "split_micro_batches",
)

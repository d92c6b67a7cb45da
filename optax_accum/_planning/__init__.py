"""``plan_micro_batches``: the largest micro-batch that fits, from XLA's memory
analysis."""

from optax_accum._planning._micro_batch_plan import MicroBatchPlan
from optax_accum._planning._plan import plan_micro_batches

__all__ = ("MicroBatchPlan", "plan_micro_batches")

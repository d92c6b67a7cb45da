"""The train step: compiled programs, accumulator layouts, the host-side choice.

The wings above import only these names.
"""

from optax_accum._step._coupled import CoupledLoss
from optax_accum._step._train_step import Mode, TrainStep, make_train_step

__all__ = ("CoupledLoss", "Mode", "TrainStep", "make_train_step")

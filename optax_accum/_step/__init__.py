"""The train step: programs, layouts, host side; the only names others import."""

from optax_accum._step._coupled import CoupledLoss
from optax_accum._step._train_step import Mode, TrainStep, make_train_step

__all__ = ("CoupledLoss", "Mode", "TrainStep", "make_train_step")

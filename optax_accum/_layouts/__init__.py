"""The accumulator's layouts, one file each, behind one protocol (``_protocol``):
one sum, per-replica partial sums, deferred partial sums, and packed sums
(only restored). The only names other layers import."""

from optax_accum._layouts import _choice
from optax_accum._layouts._deferred import (
  DeferredLayout,
  choose_leaves,
  micro_batch_like,
)
from optax_accum._layouts._packed import Packed
from optax_accum._layouts._per_replica import PerReplica, PerReplicaLayout
from optax_accum._layouts._protocol import (
  ONE_SUM,
  Body,
  Layout,
  Sharded,
  carried,
  layout_of,
  register,
  relayout,
  renamed,
  resume_target,
  saved_as,
  to_sum,
)

#: Which layout ``step.init``, or a call given a state it did not return, chooses.
layout_for_init = _choice.for_init
layout_for_call = _choice.for_call

__all__ = (
  "ONE_SUM",
  "Body",
  "DeferredLayout",
  "Layout",
  "Packed",
  "PerReplica",
  "PerReplicaLayout",
  "Sharded",
  "carried",
  "choose_leaves",
  "layout_for_call",
  "layout_for_init",
  "layout_of",
  "micro_batch_like",
  "register",
  "relayout",
  "renamed",
  "resume_target",
  "saved_as",
  "to_sum",
)

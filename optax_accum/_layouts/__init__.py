"""The accumulator's layouts, one file each, behind one protocol (``_protocol``):
one sum, per-replica partial sums, deferred partial sums, and packed sums
(only restored). The only names other layers import."""

from optax_accum._layouts import _deferred, _per_replica
from optax_accum._layouts._deferred import (
  DeferredLayout,
  choose_leaves,
  micro_batch_like,
)
from optax_accum._layouts._one_sum import ONE_SUM
from optax_accum._layouts._packed import Packed
from optax_accum._layouts._per_replica import PerReplica, PerReplicaLayout
from optax_accum._layouts._protocol import (
  Layout,
  Sharded,
  carried,
  of,
  register,
  relayout,
  renamed,
  resume_target,
  saved_as,
  to_sum,
)

#: Which layout a call or ``step.init`` runs in, where the mesh decides.
replicas_for_call = _per_replica.for_call
replicas_for_init = _per_replica.for_init
deferred_for_call = _deferred.for_call
deferred_for_init = _deferred.for_init

__all__ = (
  "ONE_SUM",
  "DeferredLayout",
  "Layout",
  "Packed",
  "PerReplica",
  "PerReplicaLayout",
  "Sharded",
  "carried",
  "choose_leaves",
  "deferred_for_call",
  "deferred_for_init",
  "micro_batch_like",
  "of",
  "register",
  "relayout",
  "renamed",
  "replicas_for_call",
  "replicas_for_init",
  "resume_target",
  "saved_as",
  "to_sum",
)

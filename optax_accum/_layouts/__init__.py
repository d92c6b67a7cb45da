"""The accumulator's layouts: how programs hold the window's sums, a small value
per layout (``_layout``: one sum, per-replica and deferred partial sums), how
they are stored between calls (``_storage``, plain functions; ``_packed``,
restored only), and which one a state gets (``_choice``). The only names other
layers import."""

from optax_accum._layouts._choice import for_call, for_init, kept
from optax_accum._layouts._layout import (
  ONE_SUM,
  Body,
  Layout,
  Sharded,
  choose_leaves,
  renamed,
)
from optax_accum._layouts._packed import Packed
from optax_accum._layouts._storage import (
  PerReplica,
  carried,
  inside,
  outside,
  per_replica_like,
  relayout,
  resume_target,
  to_sum,
  unstacked,
)

__all__ = (
  "ONE_SUM",
  "Body",
  "Layout",
  "Packed",
  "PerReplica",
  "Sharded",
  "carried",
  "choose_leaves",
  "for_call",
  "for_init",
  "inside",
  "kept",
  "outside",
  "per_replica_like",
  "relayout",
  "renamed",
  "resume_target",
  "to_sum",
  "unstacked",
)

r"""The gradient noise scale of each window, from the window's own units.

A window's *units* are the gradients it adds: one per micro-batch (and replica,
with ``axis_name``). From unit :math:`i`'s mean gradient :math:`g_i` over
:math:`w_i` items (:math:`W = \sum_i w_i`), :math:`G = \sum_i w_i g_i / W` and
:math:`A = \sum_i w_i |g_i|^2 / W` give unbiased estimates of
:math:`\operatorname{tr}\Sigma` and :math:`|\mu|^2`, with no collective of their
own (``docs/noise_scale.md``).

Examples:
  Two units of 1 and 3 items, gradients 1 and 3 (:math:`G = 2.5`,
  :math:`A = 7`):

  >>> import jax.numpy as jnp
  >>> from optax_accum._core import _reduction
  >>> noise = empty(jnp.float32)
  >>> for g, w in [(1.0, 1.0), (3.0, 3.0)]:
  ...   _, noise = added(noise, jnp.array(g), jnp.float32(w), jnp.array(True), True,
  ...                    _reduction.Local())
  >>> done = closed(noise, jnp.float32(6.25), jnp.float32(4.0), jnp.array(True),
  ...               jnp.array(True), "mean")
  >>> float(done.trace), float(done.squared_norm), float(done.units)
  (3.0, 5.5, 2.0)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike


class NoiseScaleState(NamedTuple):
  """The window's noise measurements (``MultiSteps(noise_scale=True)``).

  Attributes:
    acc_squares: float ``[]``, the weight's dtype. The window's running sum of
      :math:`w_i |g_i|^2` over its units (of :math:`|x_i|^2 / w_i` for
      gradients :math:`x_i` of sums or of shares of the window's mean).
    acc_units: Like ``acc_squares``. Units with positive weight so far.
    squared_norm: Like ``acc_squares``. The last window's unbiased estimate of
      the true gradient's squared norm :math:`|\\mu|^2`.
    trace: Like ``acc_squares``. The last window's unbiased estimate of
      :math:`\\operatorname{tr}\\Sigma`, the per-item gradient covariance's trace.
    units: Like ``acc_squares``. The last window's units: 0 for a window that
      applied no update (or whose squares overflowed); an estimate needs 2 or
      more.
  """

  acc_squares: jax.Array
  acc_units: jax.Array
  squared_norm: jax.Array
  trace: jax.Array
  units: jax.Array


def empty(dtype: DTypeLike) -> NoiseScaleState:
  """No units yet and no window measured; each field its own buffer."""
  return NoiseScaleState(*(jnp.zeros([], dtype) for _ in NoiseScaleState._fields))


def measures(noise: Any) -> bool:
  """Whether a state's ``noise_scale`` field measures (it is ``None`` if not)."""
  return isinstance(noise, NoiseScaleState)


def check_own(grads: Any, reduction: Any) -> None:
  """Raises ``ValueError`` where a gradient is not this unit's own: summed
  over replicas by JAX already, or a partial sum of one."""
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    spec = getattr(jax.typeof(g).sharding, "spec", None)
    if summed := reduction.summed_already(g) or tuple(getattr(spec, "unreduced", ())):
      raise ValueError(
        f"`updates` leaf {jax.tree_util.keystr(path)} is summed over mesh axis "
        f"{summed[0]!r} already, so the noise scale cannot see each replica's "
        "own gradient. Pass each replica's gradient (params made per-replica: "
        "jax.lax.pcast(params, axis, to='varying'), as make_train_step does), "
        "or measure without noise_scale=True."
      )


def added(
  noise: NoiseScaleState,
  grads: Any,
  weight: jax.Array,
  adds: jax.Array,
  of_mean: bool,
  reduction: Any,
) -> tuple[jax.Array, NoiseScaleState]:
  """The micro-batch's weight summed over replicas, and ``noise`` with its unit
  added (where ``adds``): one reduction for the three sums.

  The unit's term of ``acc_squares`` is :math:`w |g|^2` for a gradient of a mean
  (``of_mean``), else :math:`|x|^2 / w` for one of a sum (or of a share of the
  window's mean).
  ``grads`` in any layout, model-parallel shards summed; each replica's own
  (:func:`check_own`)."""
  check_own(grads, reduction)
  sums = [jnp.zeros([], weight.dtype)]
  for g in jax.tree.leaves(grads):
    g = jnp.abs(jnp.asarray(g)).astype(weight.dtype)
    sums.append(reduction.over_shards(jnp.sum(jnp.square(g)), weight))
  squares = jnp.sum(jnp.stack(sums))
  safe = jnp.where(weight > 0, weight, jnp.ones_like(weight))
  share = squares * weight if of_mean else squares / safe
  share = jnp.where(adds, share, jnp.zeros_like(share))
  total = reduction.sum(jnp.stack([weight, share, adds.astype(weight.dtype)]))
  return total[0], noise._replace(
    acc_squares=noise.acc_squares + total[1].astype(noise.acc_squares.dtype),
    acc_units=noise.acc_units + total[2].astype(noise.acc_units.dtype),
  )


def closed(
  noise: NoiseScaleState,
  squares: jax.Array,
  weight: jax.Array,
  ends: jax.Array,
  applies: jax.Array,
  grad_reduction: str,
) -> NoiseScaleState:
  """``noise`` after the window's end (where ``ends``), the running sums reset.

  The estimates are the window's where it applied an update with 2 or more
  units, else 0 (and ``units`` 0 where it applied none).

  Args:
    squares: :math:`|G|^2`, the squared norm of the window's mean gradient.
    weight: :math:`W`, the window's weight.
    grad_reduction: As ``MultiSteps`` takes it (shares of the window's mean
      are scaled by :math:`W^2` here).
  """
  k, dtype = noise.acc_units, noise.acc_squares.dtype
  squares, weight = squares.astype(dtype), weight.astype(dtype)
  w = jnp.where(weight > 0, weight, jnp.ones_like(weight))
  sums = noise.acc_squares * (w * w if grad_reduction == "window_mean" else 1)
  mean_square = sums / w  # A.
  many = applies & (k >= 2)
  spread = jnp.where(many, k - 1, jnp.ones_like(k))
  trace = w * (mean_square - squares) / spread
  norm = (k * squares - mean_square) / spread
  # Squares that overflowed (a finite gradient whose norm does not fit) give
  # no estimate, as a window that applied none.
  finite = jnp.isfinite(trace) & jnp.isfinite(norm)
  trace, norm = (jnp.where(many & finite, x, jnp.zeros_like(k)) for x in (trace, norm))
  units = jnp.where(applies & finite, k, jnp.zeros_like(k))
  zero = jnp.zeros_like(k)
  ended = NoiseScaleState(zero, zero, norm, trace, units)
  return jax.tree.map(lambda new, old: jnp.where(ends, new, old), ended, noise)


def metric(noise: NoiseScaleState, updated: ArrayLike = True) -> dict[str, jax.Array]:
  """The step's ``noise_scale`` metric: the last window's estimates where
  ``updated`` (the call ended a window with an update), else zeros."""
  fields = zip(NoiseScaleState._fields[2:], noise[2:], strict=True)  # Estimates.
  return {name: jnp.where(updated, x, jnp.zeros_like(x)) for name, x in fields}

"""Schedules whose argument is real progress: applied updates or items consumed."""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum._core._multi_steps import WINDOW_MICRO_STEPS, WINDOW_WEIGHT

ProgressUnit = Literal["updates", "weight"]


#: ``whole_low`` stays below this; ``whole_high`` counts its multiples.
WHOLE_BASE = 2**30


class ProgressState(NamedTuple):
  """State of a :func:`progress_schedule`.

  Items consumed are ``(whole_high * 2**30 + whole_low) * per_update +
  remainder``: an integer count of nominal updates in two int32 words (exact up
  to 2**61 of them, saturating there) plus a float remainder below
  ``per_update``, so progress stays exact long after a float32 or int32
  running total would not.

  Attributes:
    updates: int32 ``[]``, saturating. Optimizer updates applied (windows with
      positive weight).
    whole_high: int32 ``[]``. Whole multiples of ``2**30 * per_update`` items
      consumed (0 unless ``unit="weight"``).
    whole_low: int32 ``[]``. Further whole multiples of ``per_update`` items,
      in ``[0, 2**30)``.
    remainder: float ``[]``. Items consumed beyond the whole multiples, in
      ``[0, per_update)``.
  """

  updates: jax.Array
  whole_high: jax.Array
  whole_low: jax.Array
  remainder: jax.Array


def _saturating_add(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a + b`` for int32 ``a, b >= 0``, stopping at int32's maximum."""
  return jnp.where(b <= jnp.iinfo(jnp.int32).max - a, a + b, jnp.iinfo(jnp.int32).max)


class ProgressSchedule:
  """A stateful schedule (``optax.StatefulSchedule``) counting real progress.

  Build it with :func:`progress_schedule`.
  """

  def __init__(
    self, schedule: optax.Schedule, unit: ProgressUnit, per_update: float | None
  ):
    self.schedule = schedule
    self.unit = unit
    self.per_update = per_update

  def init(self) -> ProgressState:
    """No updates applied, no items consumed."""
    dtype = jnp.asarray(0.0).dtype  # float64 under jax_enable_x64.
    return ProgressState(
      updates=jnp.zeros([], jnp.int32),
      whole_high=jnp.zeros([], jnp.int32),
      whole_low=jnp.zeros([], jnp.int32),
      remainder=jnp.zeros([], dtype),
    )

  def update(self, state: ProgressState, **extra_args: Any) -> ProgressState:
    """Counts one optimizer call: an update unless ``window_weight`` is 0 in a
    loop's own call (``MultiSteps`` calls only to apply one; it says so with
    ``window_micro_steps``, and with loss terms its ``window_weight``, the
    first term's, may be 0 in a window another term updates)."""
    weight = extra_args.get(WINDOW_WEIGHT)
    if weight is None:
      if self.unit == "weight":
        raise ValueError(
          "progress_schedule(unit='weight') needs the extra argument "
          f"`{WINDOW_WEIGHT}` (items in the window an update ends): run the "
          "optimizer inside optax_accum.MultiSteps, or pass it yourself."
        )
      return state._replace(updates=optax.safe_increment(state.updates))
    weight = jnp.asarray(weight).astype(state.remainder.dtype)
    has_items = jnp.isfinite(weight) & (weight > 0)
    applied = has_items | (WINDOW_MICRO_STEPS in extra_args)
    updates = jnp.where(applied, optax.safe_increment(state.updates), state.updates)
    if self.per_update is None:
      return state._replace(updates=updates)
    per_update = jnp.asarray(self.per_update, state.remainder.dtype)
    remainder = state.remainder + jnp.where(has_items, weight, jnp.zeros_like(weight))
    carry = jnp.floor(remainder / per_update)  # Whole nominal updates, >= 0.
    # Split the carry in base 2**30 (exact: a power of two) before any int cast.
    base = jnp.asarray(WHOLE_BASE, carry.dtype)
    carry_high = jnp.floor(carry / base)
    low = state.whole_low + (carry - carry_high * base).astype(jnp.int32)
    high = jnp.minimum(carry_high, jnp.iinfo(jnp.int32).max).astype(jnp.int32)
    high = _saturating_add(_saturating_add(state.whole_high, high), low // WHOLE_BASE)
    return ProgressState(
      updates=updates,
      whole_high=high,
      whole_low=low % WHOLE_BASE,
      remainder=jnp.maximum(remainder - carry * per_update, 0),
    )

  def progress(self, state: ProgressState) -> jax.Array:
    """The schedule's argument: updates (int32), or items / ``per_update``.

    The item count is exact in the state; the argument is float32 (relative
    rounding below 1e-7), so the schedule's value has the dtype it would have
    with an update count, with or without ``jax_enable_x64``.
    """
    if self.unit == "updates":
      return state.updates
    per_update = jnp.asarray(self.per_update, state.remainder.dtype)
    fraction = (state.remainder / per_update).astype(jnp.float32)
    high = state.whole_high.astype(jnp.float32) * jnp.float32(WHOLE_BASE)
    return high + state.whole_low.astype(jnp.float32) + fraction

  def __call__(self, state: ProgressState, **extra_args: Any) -> jax.Array:
    """The schedule's value for the next update."""
    del extra_args
    if not isinstance(state, ProgressState):
      raise ValueError(
        "progress_schedule makes a stateful schedule: pass it through "
        "optax.inject_hyperparams (e.g. optax.inject_hyperparams(optax.adamw)("
        f"learning_rate=schedule)), not straight to an optimizer; got {state!r}."
      )
    return jnp.asarray(self.schedule(self.progress(state)))


def progress_schedule(
  schedule: optax.Schedule,
  *,
  unit: ProgressUnit = "updates",
  per_update: float | None = None,
) -> ProgressSchedule:
  """Makes ``schedule`` count real optimizer updates, or items consumed.

  The result is an ``optax.StatefulSchedule``: pass it to
  ``optax.inject_hyperparams`` (or ``inject_stateful_hyperparams``) in place of
  a plain schedule. Its argument is

  - ``unit="updates"``: the number of optimizer updates actually applied, so
    update ``n`` uses ``schedule(n)`` however many micro-batches it took;
  - ``unit="weight"``: items consumed (the ``window_weight`` of each update)
    divided by ``per_update``, the nominal items per update, so the curve
    follows data whatever a dynamic batcher does with window sizes.

  Inside :class:`optax_accum.MultiSteps` the optimizer runs once per window and
  receives ``window_weight``; nothing else is needed. A loop that calls the
  optimizer on every micro-step passes ``window_weight=`` itself: the window's
  items on the call that ends it, 0 on every other call. Calls with
  ``window_weight`` 0 (or negative, or not finite) count nothing, so the value
  stays constant within a window, unless they pass ``window_micro_steps`` as
  ``MultiSteps`` does: it calls the optimizer only to apply an update, and
  with loss terms its ``window_weight`` is the first term's, which may be 0
  where another term updates. Without ``window_weight`` every call counts
  as one update (``unit="updates"`` only).

  Args:
    schedule: Any optax schedule or callable of the (float or int) progress.
    unit: ``"updates"`` (default) or ``"weight"``.
    per_update: Nominal items (tokens, samples) per update; required with
      ``unit="weight"`` and only allowed there.

  Returns:
    An ``optax.StatefulSchedule`` with state :class:`ProgressState`.

  Examples:
    >>> import optax, optax_accum
    >>> lr = optax_accum.progress_schedule(optax.linear_schedule(1.0, 0.0, 4))
    >>> opt = optax_accum.MultiSteps(
    ...     optax.inject_hyperparams(optax.sgd)(learning_rate=lr), every_k_schedule=3)
    >>> state = opt.init(0.0)
    >>> for _ in range(6):  # Two windows of three micro-steps: two updates.
    ...   _, state = opt.update(1.0, state, weight=1)
    >>> float(optax_accum.get_hyperparams(state)["learning_rate"])  # Update 1's.
    0.75
  """
  if unit not in ("updates", "weight"):
    raise ValueError(f"`unit` must be 'updates' or 'weight', got {unit!r}.")
  if unit == "weight":
    if per_update is None:
      raise ValueError("`per_update` is required with unit='weight'.")
    if isinstance(per_update, bool) or not (
      isinstance(per_update, int | float)
      and math.isfinite(per_update)
      and per_update > 0
    ):
      raise ValueError(f"`per_update` must be a finite number > 0, got {per_update!r}.")
  elif per_update is not None:
    raise ValueError(
      f"`per_update` is only used with unit='weight', got {per_update!r} with "
      f"unit={unit!r}."
    )
  if not callable(schedule):
    raise ValueError(f"`schedule` must be callable, got {type(schedule).__name__}.")
  return ProgressSchedule(schedule, unit, per_update)

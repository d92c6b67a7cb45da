r"""A window size that follows the gradient noise scale (issues 62, 69, 71).

:class:`WindowController` decides where each window ends from the smoothed,
token-weighted :math:`B_\text{simple}` that ``MultiSteps(noise_scale=True)``
measures (:func:`optax_accum.smooth_noise_scale`) and from the spread of the
windows' measurements. It runs on the host: its decisions are Python numbers,
and it reads one small array a window, of a window finished before, so no
micro-step waits for the device.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._progress._noise_scale import NoiseScaleEMA, smooth_noise_scale


class NoiseScaleSpread(NamedTuple):
  """The spread of the windows' measurements, beside :class:`NoiseScaleEMA`.

  Attributes:
    squared_norm: float32 ``[]``. Moving average of the squares of
      :math:`|\\mu|^2`'s window estimates (the same weights as the average).
    trace: float32 ``[]``. Likewise for :math:`\\operatorname{tr}\\Sigma`'s.
    weights: float32 ``[]``. The sum of the squared weights of the windows
      averaged: ``total**2 / weights`` is their effective number.
  """

  squared_norm: jax.Array
  trace: jax.Array
  weights: jax.Array


class WindowControllerState(NamedTuple):
  """State of a :class:`WindowController`: save it beside the optimizer state.

  Attributes:
    ema: :class:`NoiseScaleEMA`, float32 ``[]`` each, where the measurements
      live (on the device). The moving averages so far.
    reading: float32 ``[3]``, on the device. After the window that ended
      last: the smoothed :math:`B_\\text{simple}`, and its lower and upper
      bounds from the windows' spread (0 and inf where they say nothing). Read
      when the next window ends.
    estimate: float64 ``[]``, host. The smoothed :math:`B_\\text{simple}` read
      last (0 before any).
    target: float64 ``[]``, host. The items at which this window ends: a
      rung of the ladder ``min_weight * growth**j`` (or ``max_weight``).
    weight: float64 ``[]``, host. Items in this window so far.
    micro_batches: int64 ``[]``, host. Micro-batches in this window so far.
    spread: :class:`NoiseScaleSpread`, float32 ``[]`` each, on the device.
    bounds: float64 ``[2]``, host. The bounds read last (0 and inf before any).
    streak: int64 ``[]``, host. Windows in a row, since the target last
      changed, whose bounds asked for the next rung (> 0) or the one below
      (< 0).
  """

  ema: NoiseScaleEMA
  reading: jax.Array
  estimate: np.ndarray
  target: np.ndarray
  weight: np.ndarray
  micro_batches: np.ndarray
  spread: NoiseScaleSpread
  bounds: np.ndarray
  streak: np.ndarray


def _measure(
  measured: dict[str, Any],
  ema: NoiseScaleEMA,
  spread: NoiseScaleSpread,
  decay: jax.Array,
  z: jax.Array,
) -> tuple[jax.Array, NoiseScaleEMA, NoiseScaleSpread]:
  """Adds a window's measurement; the smoothed ratio and its bounds.

  The bounds take each moving average's standard error from the windows'
  spread, as for independent windows (``var * sum(w**2) / sum(w)**2``), with
  the sample variance's ``n / (n - 1)``; :math:`|\\mu|^2` at most its upper
  bound, the trace at least its lower one, and the other way round."""
  b, new = smooth_noise_scale(measured, ema, decay=decay)
  parts = [jnp.asarray(measured[k], jnp.float32) for k in ("squared_norm", "trace")]
  counts = (jnp.asarray(measured["units"]) >= 2) & jnp.isfinite(parts[0] + parts[1])
  d = jnp.where(counts, decay, jnp.float32(1))
  squares = [jnp.where(counts, jnp.square(x), jnp.float32(0)) for x in parts]
  spread = NoiseScaleSpread(
    d * spread.squared_norm + (1 - d) * squares[0],
    d * spread.trace + (1 - d) * squares[1],
    jnp.where(counts, d * d * spread.weights + (1 - d) ** 2, spread.weights),
  )
  total = jnp.where(new.total > 0, new.total, jnp.float32(1))
  n = jnp.square(total) / jnp.where(spread.weights > 0, spread.weights, jnp.float32(1))
  enough = (new.total > 0) & (n >= 1.5)  # One window has no spread.
  share = spread.weights / jnp.square(total) * n / jnp.maximum(n - 1, jnp.float32(1))

  def interval(mean: jax.Array, square: jax.Array) -> tuple[jax.Array, jax.Array]:
    mean = mean / total
    variance = jnp.maximum(square / total - jnp.square(mean), jnp.float32(0))
    error = z * jnp.sqrt(variance * share)
    return mean - error, mean + error

  s_low, s_high = interval(new.squared_norm, spread.squared_norm)
  t_low, t_high = interval(new.trace, spread.trace)
  inf = jnp.float32(jnp.inf)
  low = jnp.where(enough & (s_high > 0) & (t_low > 0), t_low / s_high, jnp.float32(0))
  high = jnp.where(enough & (s_low > 0), t_high / jnp.where(s_low > 0, s_low, 1), inf)
  return jnp.stack([b, low, high]), new, spread


_measured = jax.jit(_measure)


def _host(value: Any, dtype: Any = np.float64) -> np.ndarray:
  """A host scalar as a 0-d array (what a checkpointer saves)."""
  return np.array(value, dtype)


def _read(x: Any) -> np.ndarray:
  """A replicated array's value, from this process's own copy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_shards[0].data
  return np.asarray(jax.device_get(x), np.float64)


def _placed(tree: Any, like: Any) -> Any:
  """``tree`` (a NamedTuple of arrays) on the devices of the measurement
  ``like`` (a copy between devices where they differ, never through the
  host)."""
  first = tree[0]
  if not isinstance(like, jax.Array) or not isinstance(first, jax.Array):
    return tree
  if first.sharding == like.sharding:
    return tree
  return type(tree)(*jax.device_put(tuple(tree), like.sharding))


def _host_scalar(value: Any) -> Any:
  """A NumPy 0-d array (what ``jax.device_get`` gives) as its Python number;
  anything else as it is."""
  if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
    return value.item()
  return value


def _positive(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"`{name}` must be a number > 0, got {value!r}.")
  number = float(value)
  if not (math.isfinite(number) and number > 0):
    raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
  return number


def _count(name: str, value: Any, least: int) -> int:
  value = _host_scalar(value)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"`{name}` must be an integer >= {least}, got {value!r}.")
  if int(value) < least:
    raise ValueError(f"`{name}` must be an integer >= {least}, got {value!r}.")
  return int(value)


_NO_NOISE = (
  "`metrics` hold no noise measurement (`metrics['noise_scale']` is {found}): "
  "the controller sizes windows from it. Build the optimizer given to "
  "`make_train_step` (or the one whose state `get_last_window` reads) as "
  "`MultiSteps(..., noise_scale=True)`."
)


def _measurement(metrics: Any) -> Mapping[str, Any]:
  """``metrics["noise_scale"]``, or a ``ValueError`` that names the fix."""
  if not isinstance(metrics, Mapping):
    raise ValueError(
      "`metrics` must be the metrics of the call that ended the window (a "
      "train step's, or get_last_window(opt_state)), a dict; got "
      f"{type(metrics).__name__}."
    )
  measured = metrics.get("noise_scale")
  if not isinstance(measured, Mapping):
    found = "absent" if measured is None and "noise_scale" not in metrics else None
    raise ValueError(_NO_NOISE.format(found=found or repr(measured)))
  missing = {"squared_norm", "trace", "units"} - set(measured)
  if missing:
    raise ValueError(
      f"`metrics['noise_scale']` must hold squared_norm, trace and units, "
      f"lacks {sorted(missing)}."
    )
  return measured


def _record(state: WindowControllerState, learning_rate: Any) -> dict[str, Any]:
  """The record of the window ``state`` ends: its target and what it held."""
  return {
    "b_simple": float(state.estimate),
    "b_low": float(state.bounds[0]),
    "b_high": float(state.bounds[1]),
    "target": float(state.target),
    "weight": float(state.weight),
    "micro_batches": int(state.micro_batches),
    "learning_rate": learning_rate,
  }


@dataclasses.dataclass(frozen=True)
class WindowController:
  r"""Ends each window at a rung of doublings that the noise scale earns.

  The target, the items at which a window ends, is a rung of the ladder
  :math:`w_\mathrm{min} g^j` (``g`` is ``growth``, 2 by default; the top rung
  ``max_weight``). It moves one rung at a time, and only on evidence: with
  :math:`[\hat B_\mathrm{low}, \hat B_\mathrm{high}]` the bounds on the
  smoothed :math:`B_\mathrm{simple}` from the spread of the windows'
  measurements (``confidence`` standard errors each side, :math:`s` the
  ``scale``), a window asks for the next rung :math:`T_+` where

  .. math::
    s \hat B_\mathrm{low} \geq \sqrt{T T_+}

  (the next rung is nearer, on a log scale, to the target the noise scale
  gives than this one), and for the rung below :math:`T_-` where
  :math:`s \hat B_\mathrm{high} \leq \sqrt{T T_-}`. The target moves after
  ``patience`` windows in a row ask the same, counted since it last moved:
  so it changes at most once every ``patience`` windows. An estimate that
  says nothing is no evidence: before two windows are measured, while the
  smoothed :math:`|\mu|^2` is not above 0 within its error (the noise scale
  reads inf, as it does while windows are small or on a plateau), or while the
  trace is not. With a constant :math:`B_\mathrm{simple}` the target settles
  on the rung nearest :math:`s B_\mathrm{simple}` (``tests/
  test_controller_settles.py``): within :math:`\sqrt{g}` of it, and on it
  where it is a rung.

  The defaults (``scale = 0.5``, ``patience = 3``, ``confidence = 1``) and
  the measurements they come from are in ``docs/noise_scale.md`` ("A window
  that follows the noise scale"). Each window holds at least
  ``min_micro_batches`` (2) micro-batches: a window of one unit measures
  nothing, and the target could never leave a ``min_weight`` one micro-batch
  holds.

  The bounds are one window old because a window's measurement is read only
  when the window after it ends: by then the device has finished it, and no
  micro-step waits for it. Where it runs:

  - **Streaming** and ``MultiSteps.update`` in your loop
    (``every_k_schedule="end_window"``): :meth:`add` each micro-batch's items
    (a host number), then :meth:`end` with the metrics of the call that ended
    the window, or ``get_last_window(opt_state)``.
  - **Scan mode**: :meth:`choose_k` picks a window's micro-batches from
    :meth:`ks`, so a step compiles a few window programs.
  - **Across replicas** (``axis_name``): count the items of all replicas; each
    replica's micro-batch is a unit (``min_micro_batches=1`` is then enough).

  The state is a small pytree of arrays (:class:`WindowControllerState`):
  checkpoint it beside the optimizer state, and a run resumed from both
  ends the same windows with the same params. An older state's checkpoint
  (no ``spread``) restores without a target, through :meth:`restore`.

  Attributes:
    min_weight: The first window's target and the ladder's foot, in items
      (tokens, samples): the reference window of ``adamw_in_items`` is a good
      one.
    max_weight: The largest target, in items.
    scale: The target's multiple of :math:`B_\text{simple}`.
    decay: The moving averages' weight of the past per window.
    growth: The ladder's factor from one rung to the next (> 1).
    grow_only: Whether the target never falls.
    patience: Windows in a row whose bounds must ask for a rung before the
      target moves to it; the fewest windows between two moves.
    confidence: The bounds' standard errors each side of the estimate.
    min_micro_batches: The fewest micro-batches a window holds (2: a window's
      measurement needs two units).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> ctl = optax_accum.WindowController(min_weight=16, max_weight=256,
    ...                                    patience=1)
    >>> state = ctl.init()
    >>> state, end = ctl.add(state, 10)
    >>> end
    False
    >>> state, end = ctl.add(state, 10)  # 20 >= 16 items: end the window.
    >>> end
    True
    >>> def noise(norm):
    ...   return {"noise_scale": {"squared_norm": jnp.float32(norm),
    ...           "trace": jnp.float32(64.0), "units": jnp.float32(4.0)}}
    >>> state, record = ctl.end(state, noise(1.0))
    >>> record["weight"], record["micro_batches"]
    (20.0, 2)
    >>> for norm in (0.9, 1.1, 1.0):  # B_simple about 64 items, 0.5 x 64 = 32.
    ...   state, record = ctl.end(ctl.add(ctl.add(state, 16)[0], 16)[0], noise(norm))
    >>> float(state.target)  # One rung up from 16, and no further.
    32.0
    >>> ctl.ks(per_micro_batch=8), ctl.choose_k(state, per_micro_batch=8)
    ((2, 4, 8, 16, 32), 4)

  References:
    McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
    https://arxiv.org/abs/1812.06162; Merrill et al. 2025, "Critical Batch
    Size Revisited", https://arxiv.org/abs/2505.23971.
  """

  min_weight: float
  max_weight: float
  scale: float = 0.5
  decay: float = 0.9
  growth: float = 2.0
  grow_only: bool = False
  patience: int = 3
  confidence: float = 1.0
  min_micro_batches: int = 2

  def __post_init__(self) -> None:
    low = _positive("min_weight", self.min_weight)
    high = _positive("max_weight", self.max_weight)
    if high < low:
      raise ValueError(
        f"`max_weight` must be >= `min_weight` ({self.min_weight!r}), got "
        f"{self.max_weight!r}."
      )
    _positive("scale", self.scale)
    if not _positive("growth", self.growth) > 1:
      raise ValueError(f"`growth` must be a number > 1, got {self.growth!r}.")
    if not (isinstance(self.decay, numbers.Real) and 0 <= self.decay < 1):
      raise ValueError(f"`decay` must be a number in [0, 1), got {self.decay!r}.")
    _count("patience", self.patience, 1)
    _count("min_micro_batches", self.min_micro_batches, 1)
    if isinstance(self.confidence, bool) or not (
      isinstance(self.confidence, numbers.Real)
      and math.isfinite(self.confidence)
      and self.confidence >= 0
    ):
      raise ValueError(
        f"`confidence` must be a finite number >= 0, got {self.confidence!r}."
      )

  def init(self) -> WindowControllerState:
    """No measurement yet: the first windows end at ``min_weight``."""
    zero = jnp.zeros([], jnp.float32)
    return WindowControllerState(
      ema=NoiseScaleEMA(zero, zero + 0, zero + 0),
      reading=jnp.array([0.0, 0.0, np.inf], jnp.float32),
      estimate=_host(0.0),
      target=_host(self.min_weight),
      weight=_host(0.0),
      micro_batches=_host(0, np.int64),
      spread=NoiseScaleSpread(zero + 0, zero + 0, zero + 0),
      bounds=np.array([0.0, np.inf]),
      streak=_host(0, np.int64),
    )

  def restore(self, tree: Any) -> WindowControllerState:
    """A state from a checkpoint restored without a target (orbax gives a
    dict of the fields by name), older layouts included.

    A checkpoint from before issue 71 (``b_simple`` and no ``spread``) keeps
    its target and its window so far; the measurement starts again (the new
    bounds need the spread the old state did not keep), so the target holds
    until the windows after the restore earn a move.

    Raises:
      ValueError: If ``tree`` is not a controller state.
    """
    if isinstance(tree, WindowControllerState):
      return tree
    if not isinstance(tree, Mapping) or "target" not in tree:
      raise ValueError(
        "`tree` must be a WindowControllerState or its fields by name (a "
        f"checkpoint restored without a target), got {type(tree).__name__}."
      )
    fresh = self.init()
    host: dict[str, Any] = {
      name: _host(tree[name], getattr(fresh, name).dtype)
      for name in ("estimate", "target", "weight", "micro_batches")
    }
    if "spread" not in tree:  # Before issue 71: the measurement restarts.
      return fresh._replace(**host)
    return WindowControllerState(
      ema=NoiseScaleEMA(**{k: jnp.asarray(v) for k, v in tree["ema"].items()}),
      reading=jnp.asarray(tree["reading"]),
      spread=NoiseScaleSpread(**{k: jnp.asarray(v) for k, v in tree["spread"].items()}),
      bounds=_host(tree["bounds"]),
      streak=_host(tree["streak"], np.int64),
      **host,
    )

  def add(
    self, state: WindowControllerState, weight: float, micro_batches: int = 1
  ) -> tuple[WindowControllerState, bool]:
    """Counts a micro-batch's items (a host number; in scan mode the window's,
    with its ``micro_batches``); returns whether the window ends with it: at
    ``target`` items and at least ``min_micro_batches`` micro-batches.

    Raises:
      ValueError: If ``weight`` is a JAX array (reading it would wait for the
        device), not a finite number >= 0 (``MultiSteps`` drops a micro-batch
        of weight inf or NaN: it adds no items), or ``micro_batches`` not an
        integer >= 1.
    """
    if isinstance(weight, jax.Array):
      raise ValueError(
        "`weight` must be a host number (count the items from the batch before "
        "it goes to the device): reading a JAX array waits for the device."
      )
    weight = _host_scalar(weight)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
      raise ValueError(f"`weight` must be a finite number >= 0, got {weight!r}.")
    if not (math.isfinite(float(weight)) and float(weight) >= 0):
      raise ValueError(f"`weight` must be a finite number >= 0, got {weight!r}.")
    _count("micro_batches", micro_batches, 1)
    total = _host(state.weight + float(weight))
    count = _host(state.micro_batches + int(micro_batches), np.int64)
    state = state._replace(weight=total, micro_batches=count)
    return state, bool(total >= state.target and count >= self.min_micro_batches)

  def end(
    self, state: WindowControllerState, metrics: dict[str, Any]
  ) -> tuple[WindowControllerState, dict[str, Any]]:
    """Ends the window: adds its measurement, sets the next window's target.

    Args:
      state: The controller's state.
      metrics: The metrics of the call that ended the window (a train step's,
        or ``get_last_window(opt_state)``): ``"noise_scale"``, and
        ``"learning_rate"`` if any. Nothing in them is read now.

    Returns:
      The new state, and the window's record: ``b_simple`` (the estimate its
      target came from), ``b_low`` and ``b_high`` (its bounds), ``target``,
      ``weight`` and ``micro_batches`` (host numbers), and ``learning_rate``
      as given (``None`` without one).

    Raises:
      ValueError: If ``metrics`` hold no noise measurement (an optimizer
        built without ``noise_scale=True``).
    """
    measured = _measurement(metrics)
    estimate, low, high = _read(state.reading)  # The window before: finished.
    ema = _placed(state.ema, measured["trace"])
    spread = _placed(state.spread, measured["trace"])
    reading, ema, spread = _measured(
      measured, ema, spread, np.float32(self.decay), np.float32(self.confidence)
    )
    record = _record(state, metrics.get("learning_rate"))
    target, streak = self._step(low, high, float(state.target), int(state.streak))
    state = WindowControllerState(
      ema=ema,
      reading=reading,
      estimate=_host(estimate),
      target=_host(target),
      weight=_host(0.0),
      micro_batches=_host(0, np.int64),
      spread=spread,
      bounds=np.array([low, high]),
      streak=_host(streak, np.int64),
    )
    return state, record

  def rungs(self) -> tuple[float, ...]:
    """The targets: ``min_weight * growth**j`` below ``max_weight``, and it."""
    out, rung = [], float(self.min_weight)
    while rung < self.max_weight * (1 - 1e-9):
      out.append(rung)
      rung *= self.growth
    return (*out, float(self.max_weight))

  def _step(
    self, low: float, high: float, target: float, streak: int
  ) -> tuple[float, int]:
    """The rule on host numbers: the bounds' vote, the streak, the move."""
    rungs = self.rungs()
    j = min(range(len(rungs)), key=lambda i: abs(math.log(rungs[i] / target)))
    up = j + 1 < len(rungs) and self.scale * low >= math.sqrt(rungs[j] * rungs[j + 1])
    down = (
      not self.grow_only
      and j > 0
      and self.scale * high <= math.sqrt(rungs[j] * rungs[j - 1])
    )  # NaN bounds vote for neither.
    if up:
      streak = streak + 1 if streak > 0 else 1
    elif down:
      streak = streak - 1 if streak < 0 else -1
    else:
      streak = 0
    if abs(streak) >= self.patience:
      return rungs[j + (1 if streak > 0 else -1)], 0
    return rungs[j], streak

  def ks(self, per_micro_batch: float) -> tuple[int, ...]:
    """Scan mode's window sizes for micro-batches of ``per_micro_batch``
    items: ``k_min``, the powers of two between, and ``k_max`` (never fewer
    than ``min_micro_batches``)."""
    per = _positive("per_micro_batch", per_micro_batch)
    low = max(self.min_micro_batches, math.ceil(self.min_weight / per))
    high = max(low, math.floor(self.max_weight / per))
    powers = {2**j for j in range(high.bit_length() + 1) if low < 2**j < high}
    return tuple(sorted(powers | {low, high}))

  def choose_k(self, state: WindowControllerState, per_micro_batch: float) -> int:
    """Scan mode: the fewest micro-batches of :meth:`ks` that hold the
    target (the most where none does)."""
    sizes = self.ks(per_micro_batch)
    enough = [k for k in sizes if k * per_micro_batch >= state.target]
    return enough[0] if enough else sizes[-1]

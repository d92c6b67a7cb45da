r"""A window size that follows the gradient noise scale (issue 62).

:class:`WindowController` decides where each window ends from the smoothed,
token-weighted :math:`B_\text{simple}` that ``MultiSteps(noise_scale=True)``
measures (:func:`optax_accum.smooth_noise_scale`). It runs on the host: its
decisions are Python numbers, and it reads one scalar a window, of a window
finished before, so no micro-step waits for the device.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._progress._noise_scale import NoiseScaleEMA, smooth_noise_scale


class WindowControllerState(NamedTuple):
  """State of a :class:`WindowController`: save it beside the optimizer state.

  Attributes:
    ema: :class:`NoiseScaleEMA`, float32 ``[]`` each, where the measurements
      live (on the device). The moving averages so far.
    b_simple: float32 ``[]``, on the device. The smoothed :math:`B_\\text{simple}`
      after the window that ended last: read when the next window ends.
    estimate: float64 ``[]``, host. The smoothed :math:`B_\\text{simple}` read
      last, the one ``target`` comes from (0 before any).
    target: float64 ``[]``, host. The items at which this window ends.
    weight: float64 ``[]``, host. Items in this window so far.
    micro_batches: int64 ``[]``, host. Micro-batches in this window so far.
  """

  ema: NoiseScaleEMA
  b_simple: jax.Array
  estimate: np.ndarray
  target: np.ndarray
  weight: np.ndarray
  micro_batches: np.ndarray


_smooth = jax.jit(smooth_noise_scale)


def _host(value: Any, dtype: Any = np.float64) -> np.ndarray:
  """A host scalar as a 0-d array (what a checkpointer saves)."""
  return np.array(value, dtype)


def _read(x: Any) -> float:
  """A replicated scalar's value, from this process's own copy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_shards[0].data
  return float(jax.device_get(x))


def _placed(ema: NoiseScaleEMA, like: Any) -> NoiseScaleEMA:
  """``ema`` on the devices of the measurement ``like`` (a copy between
  devices where they differ, never through the host)."""
  if not isinstance(like, jax.Array) or not isinstance(ema.trace, jax.Array):
    return ema
  if ema.trace.sharding == like.sharding:
    return ema
  return NoiseScaleEMA(*jax.device_put(tuple(ema), like.sharding))


def _positive(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"`{name}` must be a number > 0, got {value!r}.")
  number = float(value)
  if not (math.isfinite(number) and number > 0):
    raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
  return number


@dataclasses.dataclass(frozen=True)
class WindowController:
  r"""Ends each window at the smoothed noise scale, between two bounds.

  The rule: a window ends at the first micro-batch with which it holds at
  least ``target`` items,

  .. math::
    T_n = \min(\max(s \hat B, w_\mathrm{min}),\ w_\mathrm{max},\ g T_{n-1})

  (``s`` is ``scale``, ``g`` ``growth``, ``w`` the bounds ``min_weight`` and
  ``max_weight``, :math:`\hat B` the smoothed :math:`B_\mathrm{simple}`),

  with :math:`\hat B_\text{simple}` the moving averages' ratio
  (:func:`smooth_noise_scale`, ``decay`` per window) over the windows that
  ended before the last one: 0 (no measurement yet, or a negative one) gives
  ``min_weight``, inf (the noise swamps the signal) the upper bound.
  ``scale = 1`` trains at :math:`B_\text{simple}`, where McCandlish et al.
  (2018) find a batch spends about twice the fewest possible steps and twice
  the fewest items (:math:`B_\text{simple}` estimates their critical batch
  size): larger windows save updates, smaller ones items. ``growth = 2``
  lets the window at most double from one window to the next, as the
  batch-size warmup of Merrill et al. (2025) doubles its batch: a small
  window measures :math:`|\mu|^2` poorly (``docs/noise_scale.md``), and a
  window grows only as fast as its measurement earns. With ``grow_only`` the
  target never falls (their warmup's batch only grows).

  The estimate is one window old because a window's measurement is read
  (``float``) only when the window after it ends: by then the device has
  finished it, and no micro-step waits for it. Where it runs:

  - **Streaming** (``make_train_step``) and ``MultiSteps.update`` in your
    loop (``every_k_schedule="end_window"``): :meth:`add` each micro-batch's
    items (a host number); it says whether to end the window. Then
    :meth:`end` with the call's metrics, or
    ``get_last_window(opt_state)``.
  - **Scan mode**: :meth:`choose_k` picks the window's micro-batches from
    :meth:`ks`, ``k_min``, ``k_max`` and the powers of two between
    (``k_min = ceil(min_weight / per_micro_batch)``, ``k_max =
    floor(max_weight / per_micro_batch)``): a step compiles at most
    ``floor(log2(k_max / k_min)) + 2`` window programs.
  - **Across replicas** (``axis_name``): count the items of all replicas;
    each replica's micro-batch is a unit of the measurement.

  The state is a small pytree of arrays (:class:`WindowControllerState`):
  checkpoint it beside the optimizer state, and a run resumed from both
  ends the same windows with the same params.

  Attributes:
    min_weight: The smallest target, in items (tokens, samples).
    max_weight: The largest target, in items.
    scale: The target's multiple of :math:`B_\text{simple}`.
    decay: The moving averages' weight of the past per window.
    growth: The most the target grows from one window to the next (a factor).
    grow_only: Whether the target never falls.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> ctl = optax_accum.WindowController(min_weight=16, max_weight=256)
    >>> state = ctl.init()
    >>> state, end = ctl.add(state, 10)
    >>> end
    False
    >>> state, end = ctl.add(state, 10)  # 20 >= 16 items: end the window.
    >>> end
    True
    >>> noise = {"squared_norm": jnp.float32(1.0), "trace": jnp.float32(64.0),
    ...          "units": jnp.float32(4.0)}
    >>> state, record = ctl.end(state, {"noise_scale": noise})
    >>> record["weight"], record["micro_batches"]
    (20.0, 2)
    >>> state, record = ctl.end(ctl.add(state, 16)[0], {"noise_scale": noise})
    >>> float(state.target)  # B_simple 64 from the first window; at most 2 x 16.
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
  scale: float = 1.0
  decay: float = 0.9
  growth: float = 2.0
  grow_only: bool = False

  def __post_init__(self) -> None:
    low = _positive("min_weight", self.min_weight)
    high = _positive("max_weight", self.max_weight)
    if high < low:
      raise ValueError(
        f"`max_weight` must be >= `min_weight` ({self.min_weight!r}), got "
        f"{self.max_weight!r}."
      )
    _positive("scale", self.scale)
    if not _positive("growth", self.growth) >= 1:
      raise ValueError(f"`growth` must be a number >= 1, got {self.growth!r}.")
    if not (isinstance(self.decay, numbers.Real) and 0 <= self.decay < 1):
      raise ValueError(f"`decay` must be a number in [0, 1), got {self.decay!r}.")

  def init(self) -> WindowControllerState:
    """No measurement yet: the first windows end at ``min_weight``."""
    zero = jnp.zeros([], jnp.float32)
    return WindowControllerState(
      ema=NoiseScaleEMA(zero, zero + 0, zero + 0),
      b_simple=zero + 0,
      estimate=_host(0.0),
      target=_host(self.min_weight),
      weight=_host(0.0),
      micro_batches=_host(0, np.int64),
    )

  def add(
    self, state: WindowControllerState, weight: float, micro_batches: int = 1
  ) -> tuple[WindowControllerState, bool]:
    """Counts a micro-batch's items (a host number; in scan mode the window's,
    with its ``micro_batches``); returns whether the window ends with it.

    Raises:
      ValueError: If ``weight`` is a JAX array (reading it would wait for the
        device) or negative.
    """
    if isinstance(weight, jax.Array):
      raise ValueError(
        "`weight` must be a host number (count the items from the batch before "
        "it goes to the device): reading a JAX array waits for the device."
      )
    if not float(weight) >= 0:
      raise ValueError(f"`weight` must be a number >= 0, got {weight!r}.")
    total = _host(state.weight + float(weight))
    count = _host(state.micro_batches + micro_batches, np.int64)
    state = state._replace(weight=total, micro_batches=count)
    return state, bool(total >= state.target)

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
      target came from), ``target``, ``weight`` and ``micro_batches`` (host
      numbers), and ``learning_rate`` as given (``None`` without one).
    """
    measured = metrics["noise_scale"]
    estimate = _read(state.b_simple)  # The window before: finished.
    ema = _placed(state.ema, measured["trace"])
    b_simple, ema = _smooth(measured, ema, decay=np.float32(self.decay))
    record = {
      "b_simple": float(state.estimate),
      "target": float(state.target),
      "weight": float(state.weight),
      "micro_batches": int(state.micro_batches),
      "learning_rate": metrics.get("learning_rate"),
    }
    state = WindowControllerState(
      ema=ema,
      b_simple=b_simple,
      estimate=_host(estimate),
      target=_host(self._target(estimate, float(state.target))),
      weight=_host(0.0),
      micro_batches=_host(0, np.int64),
    )
    return state, record

  def _target(self, estimate: float, previous: float) -> float:
    """The rule: ``scale * estimate`` within the bounds, at most ``growth``
    times ``previous``, and never below it with ``grow_only``."""
    high = min(float(self.max_weight), self.growth * previous)
    wanted = self.scale * estimate if estimate > 0 else self.min_weight  # NaN too.
    target = max(min(wanted, high), float(self.min_weight))
    return max(target, previous) if self.grow_only else target

  def ks(self, per_micro_batch: float) -> tuple[int, ...]:
    """Scan mode's window sizes for micro-batches of ``per_micro_batch``
    items: ``k_min``, the powers of two between, and ``k_max``."""
    per = _positive("per_micro_batch", per_micro_batch)
    low = max(1, math.ceil(self.min_weight / per))
    high = max(low, math.floor(self.max_weight / per))
    powers = {2**j for j in range(high.bit_length() + 1) if low < 2**j < high}
    return tuple(sorted(powers | {low, high}))

  def choose_k(self, state: WindowControllerState, per_micro_batch: float) -> int:
    """Scan mode: the fewest micro-batches of :meth:`ks` that hold the
    target (the most where none does)."""
    sizes = self.ks(per_micro_batch)
    enough = [k for k in sizes if k * per_micro_batch >= state.target]
    return enough[0] if enough else sizes[-1]

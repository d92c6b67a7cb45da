r"""The gradient noise scale, smoothed over windows, for a logger or a ramp.

Each window of ``MultiSteps(noise_scale=True)`` measures unbiased estimates
of :math:`|\mu|^2` and :math:`\operatorname{tr}\Sigma`
(``metrics["noise_scale"]``, or :func:`optax_accum.get_last_window`). One
window's estimates are noisy, and their ratio is biased; McCandlish et al.
(2018, appendix A.1) smooth the two apart and take the ratio of the smoothed
values, as :func:`smooth_noise_scale` does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


class NoiseScaleEMA(NamedTuple):
  """The smoothed parts of the noise scale (see :func:`smooth_noise_scale`).

  Attributes:
    squared_norm: float32 ``[]``. Moving average of :math:`|\\mu|^2`'s
      estimates, not debiased.
    trace: float32 ``[]``. Moving average of :math:`\\operatorname{tr}\\Sigma`'s.
    total: float32 ``[]``. The moving average of 1 (what debiases the two).
  """

  squared_norm: jax.Array
  trace: jax.Array
  total: jax.Array


def _empty() -> NoiseScaleEMA:
  return NoiseScaleEMA(*(jnp.zeros([], jnp.float32) for _ in range(3)))


def smooth_noise_scale(
  measured: dict[str, Any],
  ema: NoiseScaleEMA | None = None,
  *,
  decay: ArrayLike = 0.95,
) -> tuple[jax.Array, NoiseScaleEMA]:
  r"""Adds a window's noise measurements to moving averages; their ratio.

  .. math::
    B_\text{simple} = \frac{\overline{\operatorname{tr}\Sigma}}{\overline{|\mu|^2}}

  the critical batch size's simple estimate, in the weight's items (tokens,
  samples). A measurement of fewer than 2 units (a call that ended no
  window, a window that applied no update or had one unit) leaves the
  averages as they are, so a logger may call this on every step. Runs on the
  host or traced.

  Args:
    measured: ``metrics["noise_scale"]`` of a train step, or
      ``get_last_window(opt_state)["noise_scale"]``: a dict with
      ``squared_norm``, ``trace`` and ``units``.
    ema: The averages so far, ``None`` to start.
    decay: The weight of the past per measured window.

  Returns:
    :math:`B_\text{simple}` (float32: 0 before any window is measured, inf
    where the smoothed :math:`|\mu|^2` is not positive, the noise swamping the
    signal; negative where the smoothed trace is, early on with few units)
    and the new averages.

  Examples:
    >>> import jax.numpy as jnp, optax_accum
    >>> window = {"squared_norm": jnp.float32(2.0), "trace": jnp.float32(60.0),
    ...           "units": jnp.float32(4.0)}
    >>> b, ema = optax_accum.smooth_noise_scale(window)
    >>> float(b)
    30.0
    >>> b, ema = optax_accum.smooth_noise_scale(window | {"units": 0.0}, ema)
    >>> float(b)  # Not a measurement: unchanged.
    30.0
  """
  ema = _empty() if ema is None else ema
  parts = (jnp.asarray(measured["squared_norm"]), jnp.asarray(measured["trace"]))
  finite = jnp.isfinite(parts[0]) & jnp.isfinite(parts[1])
  counts = (jnp.asarray(measured["units"]) >= 2) & finite
  d = jnp.where(counts, jnp.asarray(decay, jnp.float32), jnp.float32(1))

  def mixed(old: jax.Array, new: ArrayLike) -> jax.Array:
    new = jnp.where(counts, jnp.asarray(new).astype(jnp.float32), jnp.float32(0))
    return d * old + (1 - d) * new

  ema = NoiseScaleEMA(
    mixed(ema.squared_norm, parts[0]), mixed(ema.trace, parts[1]), mixed(ema.total, 1.0)
  )
  signal, noise = ema.squared_norm, ema.trace  # The debiasing cancels in the ratio.
  ratio = noise / jnp.where(signal > 0, signal, jnp.float32(1))
  b = jnp.where(signal > 0, ratio, jnp.float32(jnp.inf))
  return jnp.where(ema.total > 0, b, jnp.float32(0)), ema

r"""Adam whose hyperparameters follow the window's size, for batch-size ramps.

When a window holds :math:`\kappa` times the items of a reference window,
the rules that keep training on the same path (``docs/noise_scale.md``) are:

- each moving average's decay per update becomes :math:`\beta^\kappa`, so
  its half-life stays the same number of items (Busbridge et al. 2023's EMA
  scaling rule; Malladi et al. 2022's :math:`1 - \beta \to \kappa (1 - \beta)`
  to first order);
- the learning rate grows as :math:`\sqrt{\kappa}` (Malladi et al. 2022's
  square-root rule for Adam; :math:`\kappa` for SGD).

Both read ``window_weight``, the extra argument :class:`optax_accum.MultiSteps`
passes its inner optimizer at the end of every window.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from optax_accum._core._multi_steps import WINDOW_WEIGHT


def _scalar_dtype(tree: Any) -> np.dtype:
  """The dtype of the scalar arithmetic: float64 if a leaf is, else float32
  (also under bfloat16 leaves)."""
  wide = any(jnp.result_type(x) == jnp.float64 for x in jax.tree.leaves(tree))
  return np.dtype(jnp.float64 if wide else jnp.float32)


def _ratio(
  extra_args: dict[str, Any], reference_weight: Any, dtype: np.dtype
) -> jax.Array:
  """:math:`\\kappa` in ``dtype``: the window's weight over the reference's (1
  without ``window_weight``)."""
  weight = extra_args.get(WINDOW_WEIGHT)
  if weight is None:
    return jnp.ones([], dtype)
  ratio = jnp.asarray(weight, dtype) / jnp.asarray(reference_weight, dtype)
  return jnp.where(jnp.isfinite(ratio) & (ratio > 0), ratio, jnp.ones([], dtype))


def _check_reference(reference_weight: Any) -> Any:
  """``reference_weight``, checked where its value is known (an
  ``optax.inject_hyperparams`` argument is traced)."""
  if isinstance(reference_weight, jax.core.Tracer):
    return reference_weight
  value = np.asarray(reference_weight)
  numeric = value.dtype.kind in "iuf" and not value.shape
  if not numeric or not value > 0:
    raise ValueError(
      "`reference_weight` must be a number > 0 (the items of the window the "
      f"hyperparameters were tuned for), got {reference_weight!r}."
    )
  return reference_weight


class ScaleByAdamInItemsState(NamedTuple):
  """State of :func:`scale_by_adam_in_items`.

  Attributes:
    updates: int32 ``[]``. Updates so far.
    mu: Like params. The first moment.
    nu: Like params. The second moment.
    log_decay1: float32 ``[]`` (float64 for float64 params). The log of the
      product of the first moment's decays so far (its bias correction is
      ``1 - exp(log_decay1)``, computed as ``-expm1``: exact for decays close
      to 1).
    log_decay2: Like ``log_decay1``. Likewise for the second moment.
  """

  updates: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  log_decay1: jax.Array
  log_decay2: jax.Array


def scale_by_adam_in_items(
  b1: ArrayLike = 0.9,
  b2: ArrayLike = 0.999,
  eps: ArrayLike = 1e-8,
  *,
  reference_weight: float,
  nu_per_item: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""``optax.scale_by_adam`` with its decays per item, not per update.

  An update that ends a window of weight :math:`W` decays the moments by
  :math:`\beta^{W / W_\text{ref}}`; bias correction divides by one minus the
  product of the decays so far. At :math:`W = W_\text{ref}` it is
  ``optax.scale_by_adam``.

  With ``nu_per_item`` (the default) the second moment averages
  :math:`\kappa g^2`, :math:`\kappa = W / W_\text{ref}`, and the update
  divides it by the :math:`\kappa` of the window at hand. At a constant
  window this is the same :math:`\hat\nu`; when the window changes,
  :math:`\hat\nu` holds the new window's noise at once. Without it, where
  the noise dominates :math:`g^2` (:math:`E g^2 \approx \sigma^2 / W`),
  :math:`\nu` remembers the old window's noise: after a doubling it is up to
  twice too large, the steps up to :math:`\sqrt{2}` too short, for about
  :math:`1 / (1 - \beta_2)` reference windows of items. Issue 71 measured
  that cost (``tests/test_window_scaling.py``): on a noisy quadratic a switch
  from 4 to 8 items a window at half the run ended 0.0114 ± 0.0005 above the
  fixed window of 4 and 0.0076 ± 0.0011 above that of 8 (loss 0.135, 256
  seeds; ``b2 = 0.999``); with ``nu_per_item`` 0.0009 ± 0.0005 above the first
  and 0.0029 ± 0.0012 below the second. Where the signal dominates
  (:math:`g^2 \approx \mu^2`), the rescaling errs the other way for as long.

  Args:
    b1: The first moment's decay per ``reference_weight`` items.
    b2: The second moment's decay per ``reference_weight`` items.
    eps: Added to the denominator.
    reference_weight: The items of the window ``b1`` and ``b2`` were tuned for.
    nu_per_item: Whether the second moment counts the square per item (the
      noise of a window of the reference's items), so that a change of window
      rescales it at once.

  Examples:
    >>> import jax.numpy as jnp, optax_accum
    >>> adam = optax_accum.scale_by_adam_in_items(b2=0.99, reference_weight=4)
    >>> state = adam.init(jnp.zeros(()))
    >>> _, state = adam.update(jnp.ones(()), state, window_weight=8.0)
    >>> round(float(jnp.exp(state.log_decay2)), 6)  # 0.99 ** 2: twice the items.
    0.9801
  """
  reference_weight = _check_reference(reference_weight)

  def init(params: optax.Params) -> ScaleByAdamInItemsState:
    zero = jnp.zeros([], _scalar_dtype(params))
    mu, nu = optax.tree.zeros_like(params), optax.tree.zeros_like(params)
    return ScaleByAdamInItemsState(jnp.zeros([], jnp.int32), mu, nu, zero, zero + 0)

  def update(
    updates: optax.Updates,
    state: ScaleByAdamInItemsState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, ScaleByAdamInItemsState]:
    del params
    dtype = state.log_decay1.dtype
    ratio = _ratio(extra_args, reference_weight, dtype)
    # Each decay as a log, its complement by expm1: exact however close to 1.
    log1 = ratio * jnp.log(jnp.asarray(b1, dtype))
    log2 = ratio * jnp.log(jnp.asarray(b2, dtype))
    log_decay1, log_decay2 = state.log_decay1 + log1, state.log_decay2 + log2

    def moment(g: jax.Array, m: jax.Array, log: jax.Array, power: int) -> jax.Array:
      decay, rest = jnp.exp(log).astype(m.dtype), (-jnp.expm1(log)).astype(m.dtype)
      g = g.astype(m.dtype)
      if power == 2:  # Per item: kappa g^2, the noise of a reference window.
        g = jnp.square(jnp.abs(g)) * (ratio.astype(m.dtype) if nu_per_item else 1)
      return decay * m + rest * g

    mu = jax.tree.map(lambda g, m: moment(g, m, log1, 1), updates, state.mu)
    nu = jax.tree.map(lambda g, v: moment(g, v, log2, 2), updates, state.nu)

    def scaled(m: jax.Array, v: jax.Array) -> jax.Array:
      m_hat = m / (-jnp.expm1(log_decay1)).astype(m.dtype)
      v_hat = v / (-jnp.expm1(log_decay2)).astype(v.dtype)
      v_hat = v_hat / ratio.astype(v.dtype) if nu_per_item else v_hat
      return m_hat / (jnp.sqrt(v_hat) + jnp.asarray(eps, v.dtype))

    out = jax.tree.map(scaled, mu, nu)
    updates_ = optax.safe_increment(state.updates)
    return out, ScaleByAdamInItemsState(updates_, mu, nu, log_decay1, log_decay2)

  return optax.GradientTransformationExtraArgs(init, update)


def scale_by_window_weight(
  reference_weight: float, power: ArrayLike = 0.5
) -> optax.GradientTransformationExtraArgs:
  r"""Scales updates by :math:`(W / W_\text{ref})^\text{power}`: the learning
  rate's rule for a window of weight :math:`W` (0.5 for Adam, 1 for SGD).

  Examples:
    >>> import jax.numpy as jnp, optax_accum
    >>> scale = optax_accum.scale_by_window_weight(reference_weight=4)
    >>> u, _ = scale.update(jnp.ones(()), scale.init(None), window_weight=16.0)
    >>> float(u)
    2.0
  """
  reference_weight = _check_reference(reference_weight)

  def update(
    updates: optax.Updates, state: Any, params: Any = None, **extra_args: Any
  ) -> tuple[optax.Updates, Any]:
    del params
    dtype = _scalar_dtype(updates)
    factor = _ratio(extra_args, reference_weight, dtype) ** jnp.asarray(power, dtype)
    return jax.tree.map(lambda u: u * factor.astype(jnp.result_type(u)), updates), state

  return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update)


def adamw_in_items(
  learning_rate: optax.ScalarOrSchedule,
  b1: ArrayLike = 0.9,
  b2: ArrayLike = 0.999,
  eps: ArrayLike = 1e-8,
  weight_decay: ArrayLike = 1e-4,
  *,
  reference_weight: float,
  lr_power: ArrayLike = 0.5,
  nu_per_item: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW for windows of changing size: decays per item
  (:func:`scale_by_adam_in_items`) and the learning rate times
  :math:`(W / W_\text{ref})^\text{lr\_power}` (:func:`scale_by_window_weight`).
  At :math:`W = W_\text{ref}` it is ``optax.adamw``; ``nu_per_item`` (the
  default) keeps the second moment per item, so a change of window costs no
  loss (:func:`scale_by_adam_in_items`). Pass it to
  ``optax.inject_hyperparams`` for a :func:`progress_schedule` learning rate.

  Examples:
    >>> import optax, optax_accum
    >>> opt = optax_accum.MultiSteps(
    ...   optax_accum.adamw_in_items(1e-3, reference_weight=4096),
    ...   every_k_schedule="end_window")
  """
  return optax.chain(
    scale_by_adam_in_items(
      b1, b2, eps, reference_weight=reference_weight, nu_per_item=nu_per_item
    ),
    optax.add_decayed_weights(weight_decay),
    scale_by_window_weight(reference_weight, lr_power),
    optax.scale_by_learning_rate(learning_rate),
  )

"""Read hyperparameters, update counts and window losses out of any optimizer
state, for logging and evaluation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import ScheduleFreeState

from optax_accum._core import _noise
from optax_accum._core._hyperparams import find_states
from optax_accum._core._multi_steps import MultiStepsState
from optax_accum._progress._schedules import ProgressState

# Where the number of applied updates lives, most trustworthy first: an
# accumulator counts windows; a progress schedule counts updates even when its
# optimizer is called on every micro-step; an injected optimizer's own count
# only counts calls.
_COUNTERS: tuple[tuple[type, str], ...] = (
  (MultiStepsState, "gradient_step"),
  (optax.MultiStepsState, "gradient_step"),
  (ProgressState, "updates"),
  (optax.InjectStatefulHyperparamsState, "count"),
  (optax.InjectHyperparamsState, "count"),
)


def get_update_count(opt_state: optax.OptState) -> jax.Array:
  """The number of optimizer updates applied, found in any optimizer state.

  Reads, in order of preference, the window count of an ``optax_accum`` or
  ``optax`` ``MultiSteps``, the update count of a :func:`progress_schedule`,
  and the call count of ``optax.inject_hyperparams``. Inside or outside
  ``jit``.

  Args:
    opt_state: The state of any optimizer.

  Returns:
    An int32 scalar.

  Raises:
    ValueError: If the state holds none of these counters.

  Examples:
    >>> import optax, optax_accum
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> state = opt.init(0.0)
    >>> for _ in range(5):
    ...   _, state = opt.update(1.0, state, weight=1)
    >>> int(optax_accum.get_update_count(state))
    2
  """
  for node_type, field in _COUNTERS:
    found = find_states(opt_state, (node_type,))
    if found:
      return jnp.asarray(getattr(found[0], field))
  raise ValueError(
    "No update counter in this optimizer state: expected an optax_accum or "
    "optax MultiSteps, a progress_schedule, or optax.inject_hyperparams."
  )


def get_last_window(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """The loss and total weight of the window that ended last.

  For loops that call ``MultiSteps.update(..., loss=l)`` (an
  ``nnx.Optimizer``, a Linen ``TrainState``): on the micro-step that applies
  the update the running ``acc_loss`` and ``acc_weight`` are already reset,
  while these stay until the next window ends. Finds the
  :class:`optax_accum.MultiStepsState` anywhere in ``opt_state``, inside or
  outside ``jit``.

  Args:
    opt_state: The state of an optimizer holding an :class:`optax_accum.MultiSteps`.

  Returns:
    ``{"loss": ..., "weight": ...}``: the window's loss
    (:meth:`MultiSteps.window_loss`; 0 without ``loss=``) and total weight,
    both 0 before the first window ends. With ``MultiSteps(noise_scale=True)``
    also ``"noise_scale"``: the window's estimates as the train step's metric
    reports them (``docs/noise_scale.md``), its ``units`` 0 but on the call
    that ended the window: fed to :func:`smooth_noise_scale` after every
    micro-step, each window counts once.

  Raises:
    ValueError: If there is no :class:`optax_accum.MultiStepsState`.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> state = opt.init(jnp.zeros(()))
    >>> for loss, tokens in [(3.0, 1), (1.0, 3)]:
    ...   _, state = opt.update(jnp.array(1.0), state, weight=tokens, loss=loss)
    >>> window = optax_accum.get_last_window(state)
    >>> float(window["loss"]), float(window["weight"])  # (3 * 1 + 1 * 3) / 4
    (1.5, 4.0)
  """
  found = find_states(opt_state, (MultiStepsState,))
  if not found:
    raise ValueError(
      "No optax_accum.MultiStepsState in this optimizer state: the window's "
      "loss is kept by optax_accum.MultiSteps."
    )
  window: dict[str, Any] = {
    "loss": jnp.asarray(found[0].last_window_loss),
    "weight": jnp.asarray(found[0].last_window_weight),
  }
  if _noise.measures(found[0].noise_scale):
    noise = _noise.metric(jax.tree.map(jnp.asarray, found[0].noise_scale))
    ended = jnp.asarray(found[0].updated)
    noise["units"] = jnp.where(ended, noise["units"], jnp.zeros_like(noise["units"]))
    window["noise_scale"] = noise
  return window


def schedule_free_eval_params(
  opt_state: optax.OptState, params: optax.Params
) -> optax.Params:
  """``optax.contrib.schedule_free_eval_params`` for a state that holds one.

  The optax function needs the ``schedule_free`` state itself; inside
  :class:`optax_accum.MultiSteps` (or a ``chain``, an ``nnx.Optimizer``) it
  sits deeper. This finds it anywhere in ``opt_state``.

  Args:
    opt_state: The state of an optimizer holding ``optax.contrib.schedule_free``
      (``schedule_free_adamw``, ``schedule_free_sgd``).
    params: The params being trained.

  Returns:
    The params to evaluate the model with.

  Raises:
    ValueError: If there is no schedule-free state, or several.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> opt = optax_accum.MultiSteps(
    ...     optax.contrib.schedule_free_sgd(1.0, b1=0.5), every_k_schedule=2)
    >>> params = jnp.zeros(())
    >>> state = opt.init(params)
    >>> for grad in [1.0, 1.0, 2.0, 2.0]:  # Two windows.
    ...   updates, state = opt.update(jnp.array(grad), state, params, weight=1)
    ...   params = optax.apply_updates(params, updates)
    >>> float(params), float(optax_accum.schedule_free_eval_params(state, params))
    (-2.5, -2.0)
  """
  found = find_states(opt_state, (ScheduleFreeState,))
  if len(found) != 1:
    raise ValueError(
      "schedule_free_eval_params needs exactly one optax.contrib.schedule_free "
      f"state in `opt_state`, found {len(found)}."
    )
  state = jax.tree.map(jnp.asarray, found[0])  # Unwraps nnx variables.
  return optax.contrib.schedule_free_eval_params(state, params)

"""A Flax Linen ``TrainState`` that passes each micro-batch's weight on."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.typing import ArrayLike

from optax_accum._frameworks._contract import (
  check_accumulates,
  check_weight,
  find_accumulator,
  plain_update,
)


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` for :class:`MultiSteps` as ``tx``.

  ``apply_gradients(grads=g, weight=n)`` adds one micro-batch with its weight
  (Linen's own ``apply_gradients`` has no way to pass it, and without it a
  window is the uniform mean of micro-batch means). ``weight`` is required;
  ``weight=1`` asks for the uniform mean explicitly.

  A plain optax optimizer as ``tx`` (no accumulation, ``k = 1``) trains as
  Linen's own ``TrainState`` does, bit for bit, with the same ``opt_state``:
  each call is a window of one micro-batch, so ``weight`` changes nothing,
  except that a zero, negative, NaN or inf ``weight`` drops the micro-batch
  (no update, ``step`` unchanged), as ``MultiSteps(tx, 1)`` would. ``weight``
  is optional there.

  ``step`` counts optimizer updates (windows), not calls: Linen's counts every
  micro-batch. :attr:`micro_step` counts calls, for keys that differ per
  micro-batch. The state's ``opt_state`` holds the rest (see
  :func:`optax_accum.get_last_window`, :func:`optax_accum.get_update_count`).

  Subclass it as Linen's own, to add fields such as ``batch_stats``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> from optax_accum.flax import TrainState
    >>> state = TrainState.create(
    ...     apply_fn=None, params=jnp.zeros(()),
    ...     tx=optax_accum.MultiSteps(optax.sgd(1.0), every_k_schedule=2))
    >>> for grad, tokens in [(1.0, 1), (3.0, 3)]:
    ...   state = state.apply_gradients(grads=jnp.array(grad), weight=tokens)
    >>> float(state.params), int(state.step)  # -(1*1 + 3*3) / (1 + 3), 1 update
    (-2.5, 1)
  """

  @property
  def micro_step(self) -> jax.Array:
    """Micro-batches this state has taken (``apply_gradients`` calls), int32.

    The count to derive per-micro-batch keys from,
    ``jax.random.fold_in(rng, state.micro_step)``: ``step`` is the same for
    every micro-batch of a window, so keys from it repeat ``k`` times. With a
    plain optax optimizer as ``tx`` it is ``step`` (a dropped micro-batch is
    not counted, so the next one draws its key again).
    """
    where = "optax_accum.flax.TrainState.micro_step"
    state = find_accumulator(self.opt_state, where=where)
    if state is None:  # A plain optimizer: one micro-batch per update.
      return jnp.asarray(self.step, jnp.int32)
    return jnp.asarray(state.micro_batches_seen)

  def apply_gradients(
    self,
    *,
    grads: Any,
    weight: ArrayLike | None = None,
    loss: ArrayLike | None = None,
    end_window: ArrayLike | None = None,
    **kwargs: Any,
  ) -> TrainState:
    """Adds one micro-batch; applies the update if it ends the window.

    Args:
      grads: The micro-batch's gradient, like ``params``.
      weight: The count the micro-batch's loss divides by (tokens for a token
        mean, rows for a mean of per-row means; required with a
        :class:`MultiSteps`, optional with a plain optimizer; see the class).
      loss: Optional micro-batch loss: the window's loss is then kept in the
        optimizer state (:func:`optax_accum.get_last_window`) and passed to
        the inner optimizer as ``value``.
      end_window: Optional bool: end the window with this micro-batch.
      **kwargs: Other fields to replace, as in Linen's ``apply_gradients``.

    Returns:
      The new state; ``step`` is one more only if an update was applied.
    """
    where = "optax_accum.flax.TrainState.apply_gradients"
    plain = find_accumulator(self.opt_state, where=where) is None
    if plain and weight is None and loss is None and end_window is None:
      return super().apply_gradients(grads=grads, **kwargs)  # Linen's own.
    if not plain:
      check_weight(weight, where=where)
    if isinstance(grads, dict) and "_overwrite_with_gradient" in grads:
      raise ValueError(
        f"{where} does not support Flax's `_overwrite_with_gradient` collection."
      )
    if plain:
      _, opt_state, params, updated = plain_update(
        self.tx,
        grads,
        self.opt_state,
        self.params,
        weight=weight,
        loss=loss,
        end_window=end_window,
        extra_args={},
      )
      return self.replace(
        step=jnp.where(updated, self.step + 1, self.step),  # Linen's type.
        params=params,
        opt_state=opt_state,
        **kwargs,
      )
    updates, opt_state = self.tx.update(
      grads,
      self.opt_state,
      self.params,
      weight=weight,
      loss=loss,
      end_window=end_window,
    )
    updated = check_accumulates(opt_state, where=where).updated
    return self.replace(
      step=self.step + jnp.asarray(updated).astype(jnp.int32),
      params=optax.apply_updates(self.params, updates),
      opt_state=opt_state,
      **kwargs,
    )

"""A Flax NNX ``Optimizer`` whose ``step`` counts updates, not micro-batches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from optax_accum._frameworks._contract import (
  check_accumulates,
  check_weight,
  find_accumulator,
  plain_update,
)


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for :class:`MultiSteps`, one ``update`` per micro-batch.

  ``update(model, grads, weight=n)`` adds one micro-batch with its weight
  (required; ``weight=1`` asks for the uniform mean of micro-batch means
  explicitly) and applies the optimizer's update when the window ends.

  ``step`` counts optimizer updates (windows); ``nnx.Optimizer``'s counts
  every call, so ``k`` times too many. :attr:`micro_step` counts calls, for
  keys that differ per micro-batch. With ``loss=``, the finished window's
  loss stays readable after the update:
  ``optax_accum.get_last_window(optimizer.opt_state)``.

  A plain optax optimizer (no accumulation, ``k = 1``) trains as
  ``nnx.Optimizer`` does, bit for bit, with the same ``opt_state``: each call
  is a window of one micro-batch, so ``weight`` changes nothing, except that
  a zero, negative, NaN or inf ``weight`` drops the micro-batch (no update,
  ``step`` unchanged), as ``MultiSteps(tx, 1)`` would. ``weight`` is optional
  there.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum, optax_accum.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = optax_accum.flax.Optimizer(
    ...     model, optax_accum.MultiSteps(optax.adam(1e-2), 4), wrt=nnx.Param)
    >>> for _ in range(8):
    ...   grads = nnx.grad(lambda m: (m(jnp.ones((3, 2))) ** 2).mean())(model)
    ...   _ = optimizer.update(model, grads, weight=3)
    >>> int(optimizer.step)
    2
  """

  def __init__(self, model: Any, tx: Any, *, wrt: Any, **kwargs: Any):
    super().__init__(model, tx, wrt=wrt, **kwargs)
    find_accumulator(self.opt_state, where="optax_accum.flax.Optimizer")

  @property
  def micro_step(self) -> jax.Array:
    """Micro-batches this optimizer has taken (``update`` calls), int32.

    The count to derive per-micro-batch keys from,
    ``jax.random.fold_in(rng, optimizer.micro_step)``: ``step`` is the same
    for every micro-batch of a window. With a plain optax optimizer it is
    ``step`` (a dropped micro-batch is not counted).
    """
    where = "optax_accum.flax.Optimizer.micro_step"
    state = find_accumulator(self.opt_state, where=where)
    if state is None:  # A plain optimizer: one micro-batch per update.
      return jnp.asarray(self.step[...], jnp.int32)
    return jnp.asarray(state.micro_batches_seen)

  def update(
    self,
    model: Any,
    grads: Any,
    /,
    *,
    weight: ArrayLike | None = None,
    loss: ArrayLike | None = None,
    end_window: ArrayLike | None = None,
    **kwargs: Any,
  ) -> Any:
    """Adds one micro-batch; updates ``model`` if it ends the window.

    Args:
      model: The model, updated in place.
      grads: The micro-batch's gradient (``nnx.grad`` of the model).
      weight: The count the micro-batch's loss divides by (tokens for a token
        mean, rows for a mean of per-row means; required with a
        :class:`MultiSteps`, optional with a plain optimizer; see the class).
      loss: Optional micro-batch loss: kept as the window's loss and passed
        to the inner optimizer as ``value``.
      end_window: Optional bool: end the window with this micro-batch.
      **kwargs: Other extra arguments for the optimizer.

    Returns:
      The updates applied (zeros until the window ends).
    """
    where = "optax_accum.flax.Optimizer.update"
    if find_accumulator(self.opt_state, where=where) is None:
      return self._update_plain(model, grads, weight, loss, end_window, kwargs)
    check_weight(weight, where=where)
    step = self.step[...]
    updates = super().update(
      model, grads, weight=weight, loss=loss, end_window=end_window, **kwargs
    )
    updated = check_accumulates(self.opt_state, where=where).updated
    self.step[...] = step + jnp.asarray(updated).astype(step.dtype)
    return updates

  def _update_plain(
    self,
    model: Any,
    grads: Any,
    weight: ArrayLike | None,
    loss: ArrayLike | None,
    end_window: ArrayLike | None,
    kwargs: dict[str, Any],
  ) -> Any:
    """``nnx.Optimizer.update`` for a plain optimizer, dropping a bad weight."""
    if weight is None and loss is None and end_window is None:
      return super().update(model, grads, **kwargs)  # nnx.Optimizer's own.
    # As nnx.Optimizer.update, with the step in `plain_update`.
    graph = self.graph
    updates, opt_state, params, updated = plain_update(
      self.tx,
      nnx.as_pure(nnx.state(grads, self.wrt, graph=graph)),
      nnx.as_pure(self.opt_state),
      nnx.as_pure(nnx.state(model, self.wrt, graph=graph)),
      weight=weight,
      loss=loss,
      end_window=end_window,
      extra_args=nnx.as_pure(kwargs),
    )
    nnx.update(model, params)
    nnx.update(self.opt_state, nnx.state(opt_state, graph=graph))
    step = self.step[...]
    self.step[...] = step + updated.astype(step.dtype)
    return updates

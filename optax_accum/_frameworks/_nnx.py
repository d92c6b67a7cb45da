"""A Flax NNX ``Optimizer`` whose ``step`` counts updates, not micro-batches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from optax_accum._frameworks._contract import check_accumulates, check_weight


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
    check_accumulates(self.opt_state, where="optax_accum.flax.Optimizer")

  @property
  def micro_step(self) -> jax.Array:
    """Micro-batches this optimizer has taken (``update`` calls), int32.

    The count to derive per-micro-batch keys from,
    ``jax.random.fold_in(rng, optimizer.micro_step)``: ``step`` is the same
    for every micro-batch of a window.
    """
    where = "optax_accum.flax.Optimizer.micro_step"
    state = check_accumulates(self.opt_state, where=where)
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
      weight: Items behind ``grads`` (required).
      loss: Optional micro-batch loss: kept as the window's loss and passed
        to the inner optimizer as ``value``.
      end_window: Optional bool: end the window with this micro-batch.
      **kwargs: Other extra arguments for the optimizer.

    Returns:
      The updates applied (zeros until the window ends).
    """
    where = "optax_accum.flax.Optimizer.update"
    check_weight(weight, where=where)  # The state was checked when built.
    step = self.step[...]
    updates = super().update(
      model, grads, weight=weight, loss=loss, end_window=end_window, **kwargs
    )
    updated = check_accumulates(self.opt_state, where=where).updated
    self.step[...] = step + jnp.asarray(updated).astype(step.dtype)
    return updates

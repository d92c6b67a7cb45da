"""Ending a window: the finite check, the inner optimizer at most once, the
state closed; :func:`end` serves ``MultiSteps.update`` and the train step.

Compile time stays linear in the leaves: whole-tree scalars (the squared norm,
the finite flag) reach per-leaf work only as control-flow predicates
(``_backend.once_if``). XLA fuses a cheap scalar chain into each consumer, so
a flag read by every leaf's select would copy the chain over all leaves into
each.

Examples:
  One micro-batch of weight 2 ends a window of SGD at learning rate 1:

  >>> import jax.numpy as jnp, optax, optax_accum
  >>> from optax_accum._core import _reduction, _transitions
  >>> acc = optax_accum.MultiSteps(optax.sgd(1.0), every_k_schedule=1)
  >>> params, local = jnp.zeros(2), _reduction.Local()
  >>> added, _ = _transitions.add_micro_batch(acc.config, acc.init(params),
  ...   jnp.ones(2), weight=2.0, loss=None, reduction=local)
  >>> done = end(acc.config, acc.inner_opt, added, jnp.array(True),
  ...   sums=added.acc_grads, params=params, like=params, reduction=local,
  ...   loss=jnp.zeros(()), extra_args={})
  >>> done.target.tolist(), round(float(done.norm), 4), int(done.state.gradient_step)
  ([-1.0, -1.0], 1.4142, 1)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum._core import _backend, _transitions, _window
from optax_accum._core._state import MultiStepsConfig, MultiStepsState


class Ending(NamedTuple):
  """What ending a window gives."""

  target: Any  # Updates (exact zeros unless applied), or params with them applied.
  state: MultiStepsState  # After the window's end, with the new inner state.
  norm: jax.Array  # The window gradient's norm where the window applied, else 0.


def end(
  config: MultiStepsConfig,
  opt: optax.GradientTransformationExtraArgs,
  added: MultiStepsState,
  ends: jax.Array,
  *,
  sums: Any,
  params: Any,
  like: Any,
  reduction: Any,
  loss: jax.Array,
  extra_args: dict[str, Any],
  apply_to_params: bool = False,
) -> Ending:
  """Ends the window of ``added`` where ``ends``, its sums (any layout) reset.

  Only a window that ends with positive weight reads its sums; one whose
  gradient, loss or weight is not finite (on any replica) ends without an
  update. The gradient takes the dtypes of ``like``'s leaves.

  Args:
    sums: The window's sums over all replicas: one sum (laid out as ``like``).
    loss: The window's loss (``MultiSteps.window_loss``), kept in the state.
    apply_to_params: Return ``params`` with the updates applied (in place
      where the backend allows) rather than the updates.
  """
  divides, groups = config.divides, _backend.norm_groups(like)
  summed = _transitions.window_of(config, added._replace(acc_grads=sums))
  positive = ends & _window.has_weight(summed)

  def checked(_: Any) -> tuple[jax.Array, jax.Array]:
    squares = _window.squares(summed, like, divides, groups)
    return squares, _window.nonfinite(summed, squares)

  zero = jnp.zeros([], _window.weight(summed).dtype)
  squares, flag = _backend.once_if(positive, checked, (zero, jnp.array(False)))
  nonfinite = positive & reduction.any(flag, added.acc_weight)
  applies = positive & ~nonfinite

  def update(carry: Any) -> Any:
    target, inner, _ = carry
    grads = _window.gradient(summed, like, divides)
    with_inner = added._replace(inner_opt_state=inner)
    # The params the cond updates, its operand: closed over, they would need a copy.
    now = target if apply_to_params else params
    new, inner = _transitions.run_inner(config, opt, grads, with_inner, now, extra_args)
    target = optax.apply_updates(target, new) if apply_to_params else new
    return target, inner, jnp.sqrt(squares)

  # Zeros typed by once_if as the updates (a varying ``like`` would not do).
  zeros = lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x))  # noqa: E731
  start = params if apply_to_params else jax.tree.map(zeros, like)
  carry = (start, added.inner_opt_state, jnp.zeros_like(squares))
  target, inner, norm = _backend.once_if(applies, update, carry)
  if config.noise_scale:  # Over a model axis' shards of the window's gradient.
    squares = reduction.over_shards(squares, added.acc_weight)
  state = _transitions.closed(
    config, added, ends, nonfinite, applies, inner, divided_loss=loss, squares=squares
  )
  return Ending(target, state, norm)

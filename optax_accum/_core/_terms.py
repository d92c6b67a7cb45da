"""Windows of loss terms: each term keeps its own weight over the window.

An objective that sums terms normalised differently (a token-mean
cross-entropy, a per-sequence KL, a per-micro-batch auxiliary loss) needs
each term's weighted mean over the whole window: ``sum_t A_t / W_t``, with
``A_t`` the running sum of ``weight_t * grad_t`` and ``W_t`` of ``weight_t``.
No ``W_t`` is known before the window ends, so each term keeps its own sum.

A window of terms is a :class:`~optax_accum._core._window.Window` whose
``acc_grads``, ``acc_weight`` and ``acc_loss`` are tuples, one entry per term
in the order the terms were declared; a plain window is the case of one term
without the tuple. Every function here takes either, and on a plain window
does exactly what :mod:`optax_accum._core._window` does.

Examples:
  Two terms: a token mean over 1 then 3 tokens, and a per-micro-batch term
  whose two micro-batches weigh 1 each:

  >>> import jax.numpy as jnp
  >>> from optax_accum._core import _reduction, _terms
  >>> local = _reduction.Local()
  >>> window = _terms.empty(jnp.zeros(()), terms=2)
  >>> for tokens_grad, tokens, aux_grad in [(1.0, 1.0, 10.0), (3.0, 3.0, 20.0)]:
  ...   grads, weights = (tokens_grad, aux_grad), (tokens, 1.0)
  ...   kept = _terms.admit(window, grads, None, weights, reduction=local)
  ...   window = _terms.add(window, grads, None, kept, reduction=local)
  >>> grad, squares = _terms.finish(window, jnp.zeros(()))
  >>> float(grad)  # (1 * 1 + 3 * 3) / 4 + (10 + 20) / 2
  17.5
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from optax_accum._core import _window
from optax_accum._core._window import Admission, Window


def is_terms(window: Window) -> bool:
  """Whether ``window`` holds several terms (tuple sums) or one."""
  return isinstance(window.acc_weight, tuple)


def parts(window: Window) -> tuple[Window, ...]:
  """One plain window per term (``(window,)`` for a plain window)."""
  if not is_terms(window):
    return (window,)
  return tuple(
    Window(window.mini_step, g, w, loss)
    for g, w, loss in zip(
      window.acc_grads, window.acc_weight, window.acc_loss, strict=True
    )
  )


def _joined(parts_: tuple[Window, ...]) -> Window:
  return Window(
    parts_[0].mini_step,
    tuple(p.acc_grads for p in parts_),
    tuple(p.acc_weight for p in parts_),
    tuple(p.acc_loss for p in parts_),
  )


def empty(params: Any, dtype: DTypeLike | None = None, terms: int = 0) -> Window:
  """An empty window for ``params``: plain (``terms=0``) or of ``terms`` terms,
  each with its own buffers."""
  if not terms:
    return _window.empty(params, dtype)
  return _joined(tuple(_window.empty(params, dtype) for _ in range(terms)))


def admit(
  window: Window,
  grads: Any,
  loss: Any,
  weight: Any,
  *,
  reduction: Any,
  counted: ArrayLike = True,
  drop_nonfinite: bool = False,
) -> Admission | tuple[Admission, ...]:
  """:func:`~optax_accum._core._window.admit` for each term; a micro-batch is one
  unit: a bad weight (or, with ``drop_nonfinite``, a non-finite gradient or
  loss) in any term drops all of its terms."""
  if not is_terms(window):
    return _window.admit(
      window,
      grads,
      loss,
      weight,
      reduction=reduction,
      counted=counted,
      drop_nonfinite=drop_nonfinite,
    )
  losses = (None,) * len(grads) if loss is None else loss
  policy = dict(reduction=reduction, counted=counted, drop_nonfinite=drop_nonfinite)
  each = [
    _window.admit(part, g, value, w, **policy)
    for part, g, value, w in zip(parts(window), grads, losses, weight, strict=True)
  ]
  dropped = jnp.any(jnp.stack([a.dropped for a in each]))
  return tuple(
    Admission(
      jnp.where(dropped, jnp.zeros_like(a.weight), a.weight),
      a.adds & ~dropped,
      a.counted,
      dropped,
    )
    for a in each
  )


def dropped(kept: Admission | tuple[Admission, ...]) -> jax.Array:
  """Whether the micro-batch was dropped (by its weight or its values)."""
  return kept.dropped if isinstance(kept, Admission) else kept[0].dropped


def add(
  window: Window,
  grads: Any,
  loss: Any,
  kept: Any,
  *,
  reduction: Any,
  weigh: bool = True,
) -> Window:
  """``window`` with an admitted micro-batch added, term by term."""
  if not is_terms(window):
    return _window.add(window, grads, loss, kept, reduction=reduction, weigh=weigh)
  losses = (None,) * len(grads) if loss is None else loss
  return _joined(
    tuple(
      _window.add(part, g, value, k, reduction=reduction, weigh=weigh)
      for part, g, value, k in zip(parts(window), grads, losses, kept, strict=True)
    )
  )


def gradient(window: Window, grads_like: Any, divide: bool = True) -> Any:
  """The window's gradient, ``sum_t A_t / W_t``: a term of weight 0 adds
  nothing (see :func:`~optax_accum._core._window.gradient`)."""
  if not is_terms(window):
    return _window.gradient(window, grads_like, divide)
  total = None
  for part in parts(window):
    some = part.acc_weight > 0
    grad = jax.tree.map(
      lambda g, some=some: jnp.where(some, g, jnp.zeros_like(g)),
      _window.gradient(part, grads_like, divide),
    )
    total = grad if total is None else jax.tree.map(jnp.add, total, grad)
  return total


def squares(window: Window, grads_like: Any, divide: bool = True) -> jax.Array:
  """The squared norm of :func:`gradient` (see
  :func:`~optax_accum._core._window.squares`)."""
  if not is_terms(window):
    return _window.squares(window, grads_like, divide)
  one = jnp.ones([], window.acc_weight[0].dtype)
  total = gradient(window, grads_like, divide)
  return _window.squares(Window(window.mini_step, total, one, one), grads_like, False)


def finish(
  window: Window, grads_like: Any, divide: bool = True
) -> tuple[Any, jax.Array]:
  """The window's gradient and its squared norm."""
  if not is_terms(window):
    return _window.finish(window, grads_like, divide)
  return gradient(window, grads_like, divide), squares(window, grads_like, divide)


def nonfinite(window: Window, squares: jax.Array) -> jax.Array:
  """Whether the window's gradient, losses or weights hold a NaN or an inf."""
  return _window.nonfinite(window, squares)


def reset(window: Window, ends: ArrayLike, keep_sum: bool = False) -> Window:
  """An empty window where ``ends`` (see :func:`~optax_accum._core._window.reset`)."""
  if not is_terms(window):
    return _window.reset(window, ends, keep_sum)
  return _joined(tuple(_window.reset(p, ends, keep_sum) for p in parts(window)))


def has_weight(window: Window) -> jax.Array:
  """Whether any term has positive weight: the window can apply an update."""
  if not is_terms(window):
    return window.acc_weight > 0
  return jnp.any(jnp.stack([p.acc_weight > 0 for p in parts(window)]))


def weight(window: Window) -> jax.Array:
  """The window's weight: its first term's (what schedules in items count)."""
  return parts(window)[0].acc_weight


def mean_loss(window: Window, shares: bool = False) -> jax.Array:
  """The objective so far: the sum of each term's weighted mean loss."""
  means = [_window.mean_loss(p, shares) for p in parts(window)]
  return means[0] if len(means) == 1 else sum(means[1:], means[0])


def term_metrics(window: Window, names: tuple[str, ...]) -> dict[str, Any]:
  """Each term's mean loss and total weight so far, by name."""
  return {
    name: {"loss": _window.mean_loss(part), "weight": part.acc_weight}
    for name, part in zip(names, parts(window), strict=True)
  }

"""Windows of loss terms: each term keeps its own weight over the window.

Terms normalised differently (a token-mean cross-entropy, a per-sequence KL)
need each term's weighted mean over the window, ``sum_t A_t / W_t`` (``A_t`` the
sum of ``weight_t * grad_t``, ``W_t`` of ``weight_t``), and no ``W_t`` is known
before the window ends. A window here is a tuple of
:class:`~optax_accum._core._window.Window`, one per term in declared order (a
plain window is one term); :func:`split` and :func:`joined` convert to and from
the state's fields.

Examples:
  Two terms: a token mean over 1 then 3 tokens, and a per-micro-batch term
  whose two micro-batches weigh 1 each:

  >>> import jax.numpy as jnp
  >>> from optax_accum._core import _reduction, _terms
  >>> local = _reduction.Local()
  >>> window = _terms.empty(jnp.zeros(()), terms=("tokens", "aux"))
  >>> for tokens_grad, tokens, aux_grad in [(1.0, 1.0, 10.0), (3.0, 3.0, 20.0)]:
  ...   grads, weights = (tokens_grad, aux_grad), (tokens, 1.0)
  ...   kept = _terms.admit(window, grads, (None, None), weights, reduction=local)
  ...   window = _terms.add(window, grads, (None, None), kept, reduction=local)
  >>> # (1 * 1 + 3 * 3) / 4 + (10 + 20) / 2:
  >>> float(_terms.gradient(window, jnp.zeros(())))
  17.5
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from optax_accum._core import _window
from optax_accum._core._window import Admission, Groups, Window

#: A window of one or more terms, one plain window each.
Terms = tuple[Window, ...]
Names = tuple[str, ...] | None


def per_term(stored: Any, names: Names) -> tuple[Any, ...]:
  """A window field of the state (``acc_grads``, ...) as one entry per term."""
  return (stored,) if names is None else tuple(stored)


def stored(entries: tuple[Any, ...], names: Names) -> Any:
  """The inverse of :func:`per_term`."""
  return entries[0] if names is None else tuple(entries)


def split(window: Window, names: Names) -> Terms:
  """A state's window as one window per term; noise measurements ride on the first."""
  fields = (per_term(f, names) for f in window[1:-1])
  parts = [Window(window.mini_step, *f) for f in zip(*fields, strict=True)]
  parts[0] = parts[0]._replace(noise_scale=window.noise_scale)
  return tuple(parts)


def joined(window: Terms, names: Names) -> Window:
  """The inverse of :func:`split`: ``window`` as a state's fields."""
  fields = (stored(f, names) for f in list(zip(*window, strict=True))[1:-1])
  joined = Window(window[0].mini_step, *fields)
  return joined._replace(noise_scale=window[0].noise_scale)


def empty(params: Any, dtype: DTypeLike | None = None, terms: Names = None) -> Terms:
  """An empty window for ``params``: one term, or one per name in ``terms``."""
  return tuple(_window.empty(params, dtype) for _ in terms or (None,))


def admit(
  window: Terms,
  grads: tuple[Any, ...],
  loss: tuple[Any, ...],
  weight: tuple[Any, ...],
  *,
  reduction: Any,
  counted: ArrayLike = True,
  drop_nonfinite: bool = False,
) -> tuple[Admission, ...]:
  """:func:`~optax_accum._core._window.admit` for each term; a micro-batch
  dropped in any term is dropped in all."""
  policy = dict(reduction=reduction, counted=counted, drop_nonfinite=drop_nonfinite)
  each = tuple(
    _window.admit(part, g, value, w, **policy)
    for part, g, value, w in zip(window, grads, loss, weight, strict=True)
  )
  if len(each) == 1:
    return each
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


def add(
  window: Terms,
  grads: tuple[Any, ...],
  loss: tuple[Any, ...],
  kept: tuple[Admission, ...],
  *,
  reduction: Any,
  weigh: bool = True,
) -> Terms:
  """``window`` with an admitted micro-batch added, term by term."""
  return tuple(
    _window.add(part, g, value, k, reduction=reduction, weigh=weigh)
    for part, g, value, k in zip(window, grads, loss, kept, strict=True)
  )


def spoil(window: Terms, where: ArrayLike) -> Terms:
  """Every term spoiled where ``where`` (:func:`~optax_accum._core._window.spoil`)."""
  return tuple(_window.spoil(part, where) for part in window)


def gradient(window: Terms, like: Any, divide: bool = True) -> Any:
  """The window's gradient ``sum_t A_t / W_t`` in ``like``'s dtypes; a term of
  weight 0 adds nothing."""
  if len(window) == 1:
    return _window.gradient(window[0], like, divide)
  total = None
  for part in window:
    some = part.acc_weight > 0
    grad = jax.tree.map(
      lambda g, some=some: jnp.where(some, g, jnp.zeros_like(g)),
      _window.gradient(part, like, divide),
    )
    total = grad if total is None else jax.tree.map(jnp.add, total, grad)
  return total


def squares(
  window: Terms, like: Any, divide: bool = True, groups: Groups = ()
) -> jax.Array:
  """The squared norm of :func:`gradient`, NaN where it is not finite (see
  :func:`~optax_accum._core._window.squares`)."""
  if len(window) == 1:
    return _window.squares(window[0], like, divide, groups)
  one = jnp.ones([], window[0].acc_weight.dtype)
  total = Window(window[0].mini_step, gradient(window, like, divide), one, one)
  return _window.squares(total, like, False, groups)


def nonfinite(window: Terms, squares: jax.Array) -> jax.Array:
  """Whether the window's gradient, losses or weights hold a NaN or an inf."""
  losses, weights = (
    tuple(p.acc_loss for p in window),
    tuple(p.acc_weight for p in window),
  )
  return jnp.isnan(squares) | ~_window.all_finite(losses, weights)


def reset(window: Terms, ends: ArrayLike) -> Terms:
  """An empty window where ``ends`` (see :func:`~optax_accum._core._window.reset`)."""
  return tuple(_window.reset(part, ends) for part in window)


def has_weight(window: Terms) -> jax.Array:
  """Whether any term has positive weight: the window can apply an update."""
  if len(window) == 1:
    return window[0].acc_weight > 0
  return jnp.any(jnp.stack([p.acc_weight > 0 for p in window]))


def weight(window: Terms) -> jax.Array:
  """The window's weight: its first term's (what schedules in items count)."""
  return window[0].acc_weight


def mean_loss(window: Terms, shares: bool = False) -> jax.Array:
  """The objective so far: the sum of each term's weighted mean loss."""
  means = [_window.mean_loss(p, shares) for p in window]
  return sum(means[1:], means[0])


def term_metrics(window: Terms, names: tuple[str, ...]) -> dict[str, Any]:
  """Each term's mean loss and total weight so far, by name."""
  return {
    name: {"loss": _window.mean_loss(part), "weight": part.acc_weight}
    for name, part in zip(names, window, strict=True)
  }

"""The window: the running sums of one accumulation window, term by term.

Terms normalised differently (a token-mean cross-entropy, a per-sequence KL)
need each term's weighted mean over the window, ``sum_t A_t / W_t`` (``A_t`` the
sum of ``weight_t * grad_t``, ``W_t`` of ``weight_t``), and no ``W_t`` is known
before the window ends. So a window is a tuple of :class:`Window`, one per loss
term in declared order, and a window without terms is one term. Pure functions:
admit a micro-batch, add it, end the window in its gradient and squared norm,
reset; :func:`per_term_windows` and :func:`as_state_fields` convert from and to
the state's fields. No optax and no collectives: what is summed over replicas
goes through the caller's ``reduction`` policy (:mod:`optax_accum._core._reduction`).

Examples:
  Two micro-batches of 1 and 3 items; the window's gradient is their item mean:

  >>> import jax.numpy as jnp
  >>> from optax_accum._core import _reduction, _window
  >>> local = _reduction.Local()
  >>> window = _window.empty(jnp.zeros(()))
  >>> for grad, weight in [(1.0, 1.0), (3.0, 3.0)]:
  ...   kept = _window.admit(window, (grad,), (None,), (weight,), reduction=local)
  ...   window = _window.add(window, (grad,), (None,), kept, reduction=local)
  >>> like = jnp.zeros(())
  >>> float(_window.gradient(window, like)), float(_window.squares(window, like))
  (2.5, 6.25)

  Two terms: a token mean over 1 then 3 tokens, and a per-micro-batch term
  whose two micro-batches weigh 1 each:

  >>> window = _window.empty(jnp.zeros(()), terms=("tokens", "aux"))
  >>> for tokens_grad, tokens, aux_grad in [(1.0, 1.0, 10.0), (3.0, 3.0, 20.0)]:
  ...   grads, weights = (tokens_grad, aux_grad), (tokens, 1.0)
  ...   kept = _window.admit(window, grads, (None, None), weights, reduction=local)
  ...   window = _window.add(window, grads, (None, None), kept, reduction=local)
  >>> # (1 * 1 + 3 * 3) / 4 + (10 + 20) / 2:
  >>> float(_window.gradient(window, jnp.zeros(())))
  17.5
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike, DTypeLike

from optax_accum._core import _backend, _checks, _noise

#: Leaf indices summed as one (``_backend.norm_groups``).
Groups = tuple[tuple[int, ...], ...]
#: Loss terms' names, or ``None``: a window of one term.
Names = tuple[str, ...] | None


class Window(NamedTuple):
  """The window in progress: ``MultiStepsState``'s window fields (documented there)."""

  mini_step: jax.Array
  acc_grads: Any
  acc_weight: Any  # A scalar here; a tuple of them in a window of terms.
  acc_loss: Any
  noise_scale: Any = None


#: A window: one :class:`Window` per term, in declared order (one without terms).
Terms = tuple[Window, ...]


class Admission(NamedTuple):
  """What one micro-batch does to a term (see :func:`admit`)."""

  weight: jax.Array  # Its weight where its gradient adds, else 0.
  adds: jax.Array  # Whether its gradient joins the window.
  counted: jax.Array  # Whether it counts towards the window's length.
  dropped: jax.Array  # Whether it was dropped on its own (counted as skipped).


def accumulator_dtype(leaf_dtype: DTypeLike, chosen: DTypeLike | None = None) -> Any:
  """The accumulator dtype for a leaf: ``chosen``, or float32 at least.

  Examples:
    >>> accumulator_dtype(jnp.bfloat16), accumulator_dtype(jnp.float64)
    (dtype('float32'), dtype('float64'))
  """
  if chosen is not None:
    return jnp.dtype(chosen)
  complex_ = jnp.issubdtype(leaf_dtype, jnp.complexfloating)
  return _wider(jnp.complex64 if complex_ else jnp.float32, leaf_dtype)


def _wider(a: DTypeLike, b: DTypeLike) -> Any:
  """The wider of two dtypes; ``a`` where they are as wide."""
  a, b = jnp.dtype(a), jnp.dtype(b)
  return a if a.itemsize >= b.itemsize else b


def _empty(params: Any, dtype: DTypeLike | None = None) -> Window:
  """An empty window for ``params``; the accumulator is sharded like them."""

  def zeros(p: Any) -> jax.Array:
    return jnp.zeros_like(p, dtype=accumulator_dtype(jnp.result_type(p), dtype))

  acc = jax.tree.map(zeros, params)
  dtypes = [a.dtype for a in jax.tree.leaves(acc)]
  floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)]
  wide = functools.reduce(_wider, floats, jnp.float32)
  # Each field its own buffer: a state is donated leaf by leaf.
  return Window(jnp.zeros([], jnp.int32), acc, jnp.zeros([], wide), jnp.zeros([], wide))


def all_finite(*trees: Any) -> jax.Array:
  """Whether every element of every leaf is finite (a bool scalar)."""
  each = (jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(trees))
  return functools.reduce(jnp.logical_and, each, jnp.array(True))


def _zeroed(where: ArrayLike, x: jax.Array) -> jax.Array:
  """Zeros where ``where``, ``x`` elsewhere."""
  return jnp.where(where, jnp.zeros_like(x), x)


def _times(x: jax.Array, factor: jax.Array) -> jax.Array:
  """``x * factor`` for a replicated scalar ``factor``; for ``unreduced`` partial
  sums ``factor`` is typed ``reduced`` over the same axes, which moves nothing."""
  sharding = jax.typeof(x).sharding
  if axes := getattr(getattr(sharding, "spec", None), "unreduced", ()):
    factor = jax.reshard(factor, NamedSharding(sharding.mesh, P(reduced=set(axes))))
  return x * factor


def _rounded(x: jax.Array, dtype: Any) -> jax.Array:
  """``x`` in ``dtype``, rounded there on every backend by a barrier on a narrowing
  cast: XLA:GPU (excess precision on, its default) drops a narrowing convert that
  a widening one follows, so an overflowing float16 sum would stay finite when the
  window ends in the same program, unlike the stored one. XLA:CPU removes the
  barrier before fusion."""
  if jnp.dtype(dtype).itemsize < jnp.dtype(x.dtype).itemsize:
    return jax.lax.optimization_barrier(x.astype(dtype))
  return x.astype(dtype)


def _add(
  window: Window, grads: Any, loss: Any, kept: Admission, reduction: Any, weigh: bool
) -> Window:
  """One term's :func:`add`."""
  noise = window.noise_scale
  if _noise.measures(noise):
    total, noise = _noise.added(noise, grads, kept.weight, kept.adds, weigh, reduction)
  else:
    total = reduction.sum(kept.weight)

  def weighted(x: Any, dtype: Any, name: str) -> jax.Array:
    """``weight * x`` (or ``x``) where the micro-batch adds, else 0, at least as
    wide as the weight: a float16 sum must not turn a weight of 70000 into inf."""
    x = jnp.asarray(x).astype(_wider(dtype, kept.weight.dtype))
    if not reduction.summed_already(x):
      x = _times(x, kept.weight.astype(x.dtype)) if weigh else x
      return jnp.where(kept.adds, x, jnp.zeros_like(x))
    if weigh:
      raise ValueError(
        f"{name} is already summed over mesh axis {reduction.summed_already(x)[0]!r} "
        "(JAX's autodiff sums the gradient of params that enter shard_map replicated), "
        "so the per-replica weights cannot be applied. Use grad_reduction='sum' with a "
        "summed loss, or make the params per-replica first: jax.lax.pcast(params, "
        "axis, to='varying') (make_train_step does this)."
      )
    return jnp.where(kept.counted & (total > 0), x, jnp.zeros_like(x))

  acc_loss = window.acc_loss
  if loss is not None:
    loss = _checks.scalar(loss, name="loss", dtype=acc_loss.dtype)
    acc_loss = acc_loss + reduction.sum(weighted(loss, acc_loss.dtype, "`loss`"))
  first = window.mini_step == 0

  def accumulate(path: Any, acc: jax.Array, g: Any) -> jax.Array:
    name = f"`updates` leaf {jax.tree_util.keystr(path)}"
    term = reduction.gradient(weighted(g, acc.dtype, name))
    start = _zeroed(first, acc).astype(term.dtype)
    return _rounded(start + term, acc.dtype)

  mini_step = jnp.where(kept.counted, _increment(window.mini_step), window.mini_step)
  grads = jax.tree_util.tree_map_with_path(accumulate, window.acc_grads, grads)
  return Window(mini_step, grads, window.acc_weight + total, acc_loss, noise)


def _increment(count: jax.Array) -> jax.Array:
  """``count + 1``, saturating at the dtype's maximum."""
  top = jnp.iinfo(count.dtype).max
  return jnp.where(count < top, count + 1, count)


def _gradient(window: Window, like: Any, divide: bool = True) -> Any:
  """The window's sum times ``1 / weight`` (if ``divide``), in ``like``'s dtypes:
  a product with the reciprocal (within 1 ulp of the quotient), which XLA fuses
  into the optimizer's ops where a quotient gets a buffer."""
  inverse = 1 / (window.acc_weight if divide else jnp.ones_like(window.acc_weight))

  def leaf(acc: jax.Array, like: Any) -> jax.Array:
    dtype = _wider(acc.dtype, inverse.dtype)
    product = acc.astype(dtype) * inverse.astype(dtype)
    return product.astype(jnp.result_type(like))

  return jax.tree.map(leaf, window.acc_grads, like)


def _mean_loss(window: Window, shares: bool = False) -> jax.Array:
  """The window's token-mean loss so far (0 without weight). ``shares``: the
  losses are already shares of the window's mean, and are summed.

  Examples:
    >>> w = Window(jnp.int32(2), None, jnp.float32(4.0), jnp.float32(10.0))
    >>> float(_mean_loss(w)), float(_mean_loss(w, shares=True))
    (2.5, 10.0)
  """
  if shares:
    return jnp.asarray(window.acc_loss)
  positive = window.acc_weight > 0
  weight = jnp.where(positive, window.acc_weight, jnp.ones_like(window.acc_weight))
  return jnp.where(positive, window.acc_loss / weight, jnp.zeros_like(weight))


def per_term(stored: Any, names: Names) -> tuple[Any, ...]:
  """A window field of the state (``acc_grads``, ...) as one entry per term."""
  return (stored,) if names is None else tuple(stored)


def stored(entries: tuple[Any, ...], names: Names) -> Any:
  """The inverse of :func:`per_term`."""
  return entries[0] if names is None else tuple(entries)


def per_term_windows(window: Window, names: Names) -> Terms:
  """A state's window fields as one window per term; noise measurements ride on
  the first."""
  fields = zip(*(per_term(f, names) for f in window[1:-1]), strict=True)
  parts = [Window(window.mini_step, *f) for f in fields]
  return (parts[0]._replace(noise_scale=window.noise_scale), *parts[1:])


def as_state_fields(window: Terms, names: Names) -> Window:
  """The inverse of :func:`per_term_windows`: ``window`` as a state's fields."""
  fields = (stored(f, names) for f in list(zip(*window, strict=True))[1:-1])
  return Window._make((window[0].mini_step, *fields, window[0].noise_scale))


def empty(params: Any, dtype: DTypeLike | None = None, terms: Names = None) -> Terms:
  """An empty window for ``params``: one term, or one per name in ``terms``."""
  return tuple(_empty(params, dtype) for _ in terms or (None,))


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
  """What a micro-batch adds to each term (the bad-weight and non-finite policy):
  a negative or non-finite weight on any replica, or with ``drop_nonfinite`` a
  non-finite gradient or loss, drops it on all and in every term, though it counts
  towards ``k``; weight 0 and ``counted=False`` add nothing and drop nothing."""

  def one(part: Window, grads: Any, loss: Any, weight: Any) -> Admission:
    w = _checks.scalar(weight, name="weight", dtype=part.acc_weight.dtype)
    w, is_counted = reduction.own(w), jnp.asarray(counted)
    shards = (w, part.acc_weight)
    dropped = reduction.any(is_counted & ~(jnp.isfinite(w) & (w >= 0)), shards)
    adds = is_counted & ~dropped & (w > 0)
    if drop_nonfinite:
      finite = all_finite(grads, () if loss is None else loss)
      bad = reduction.any(adds & ~finite, shards)
      adds, dropped = adds & ~bad, dropped | (is_counted & bad)
    return Admission(jnp.where(adds, w, jnp.zeros_like(w)), adds, is_counted, dropped)

  each = tuple(one(*t) for t in zip(window, grads, loss, weight, strict=True))
  if len(each) == 1:
    return each
  dropped = jnp.any(jnp.stack([a.dropped for a in each]))
  return tuple(
    Admission(_zeroed(dropped, a.weight), a.adds & ~dropped, a.counted, dropped)
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
  """``window`` with an admitted micro-batch added, term by term: with ``weigh``
  the gradient and loss are means, times the weight, else sums; each add rounds
  once, and the window's first micro-batch overwrites the accumulator."""
  terms = zip(window, grads, loss, kept, strict=True)
  return tuple(_add(*term, reduction, weigh) for term in terms)


def spoil(window: Terms, where: ArrayLike) -> Terms:
  """Every term with a NaN sum where ``where``, so that the window ends without an
  update: for shares of the window's mean, which cannot drop one micro-batch alone.

  Examples:
    >>> w = spoil(empty(jnp.zeros(2)), True)
    >>> bool(jnp.isnan(squares(w, jnp.zeros(2))))
    True
  """
  nan = lambda a: jnp.where(where, jnp.full_like(a, jnp.nan), a)  # noqa: E731
  return tuple(p._replace(acc_grads=jax.tree.map(nan, p.acc_grads)) for p in window)


def gradient(window: Terms, like: Any, divide: bool = True) -> Any:
  """The window's gradient ``sum_t A_t / W_t`` in ``like``'s dtypes; a term of
  weight 0 adds nothing."""
  if len(window) == 1:
    return _gradient(window[0], like, divide)

  def term(part: Window) -> Any:
    some, grad = part.acc_weight > 0, _gradient(part, like, divide)
    return jax.tree.map(lambda g: jnp.where(some, g, jnp.zeros_like(g)), grad)

  return functools.reduce(functools.partial(jax.tree.map, jnp.add), map(term, window))


def squares(
  window: Terms, like: Any, divide: bool = True, groups: Groups = ()
) -> jax.Array:
  """The squared norm of :func:`gradient`: NaN exactly when an element is not
  finite (:func:`~optax_accum._core._backend.nan_marker`), inf when only the
  squares overflow; one pass serves both the finite check and the norm.

  ``groups``: leaves of one shape whose sums are one variadic reduction, a
  kernel (:func:`~optax_accum._core._backend.norm_groups`); the others are a
  reduction each. The sums are added in leaf order."""
  part, dtype = window[0], window[0].acc_weight.dtype
  if len(window) > 1:  # The terms' gradient, as one term of weight 1.
    one, grads = jnp.ones([], dtype), gradient(window, like, divide)
    part, divide = Window(part.mini_step, grads, one, one), False

  def terms(g: jax.Array) -> jax.Array:
    g = jnp.abs(g).astype(dtype)
    return jnp.square(g) + _backend.nan_marker(g)

  leaves = [terms(g) for g in jax.tree.leaves(_gradient(part, like, divide))]
  sums: dict[int, jax.Array] = {}
  for group in groups:  # One variadic reduction: a sum per leaf, one kernel.
    parts = [leaves[i] for i in group]
    zeros = [jnp.zeros([], dtype)] * len(parts)
    dims = tuple(range(jnp.ndim(parts[0])))
    add = lambda a, b: [x + y for x, y in zip(a, b, strict=True)]  # noqa: E731
    sums.update(zip(group, jax.lax.reduce(parts, zeros, add, dims), strict=True))
  each = (sums[i] if i in sums else jnp.sum(g) for i, g in enumerate(leaves))
  return sum(each, jnp.zeros([], dtype))


def nonfinite(window: Terms, squares: jax.Array) -> jax.Array:
  """Whether the window's gradient, losses or weights hold a NaN or an inf."""
  losses, weights = [p.acc_loss for p in window], [p.acc_weight for p in window]
  return jnp.isnan(squares) | ~all_finite(losses, weights)


def reset(window: Terms, ends: ArrayLike) -> Terms:
  """An empty window where ``ends``, ``window`` elsewhere; a selection, so no NaN
  reaches the next window. Noise measurements are left to ``_noise.closed``."""
  zero = functools.partial(_zeroed, ends)
  # Each term's sums zeroed, its noise_scale (p[-1]) kept:
  return tuple(Window._make((*jax.tree.map(zero, p[:-1]), p[-1])) for p in window)


def has_weight(window: Terms) -> jax.Array:
  """Whether any term has positive weight: the window can apply an update."""
  positive = [p.acc_weight > 0 for p in window]
  return positive[0] if len(positive) == 1 else jnp.any(jnp.stack(positive))


def weight(window: Terms) -> jax.Array:
  """The window's weight: its first term's (what schedules in items count)."""
  return window[0].acc_weight


def mean_loss(window: Terms, shares: bool = False) -> jax.Array:
  """The objective so far: the sum of each term's weighted mean loss."""
  return functools.reduce(jnp.add, (_mean_loss(p, shares) for p in window))


def term_metrics(window: Terms, names: tuple[str, ...]) -> dict[str, Any]:
  """Each term's mean loss and total weight so far, by name."""
  parts = zip(names, window, strict=True)
  return {name: {"loss": _mean_loss(p), "weight": p.acc_weight} for name, p in parts}

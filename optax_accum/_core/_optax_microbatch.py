"""A token-weighted accumulator for ``optax.microbatch``.

optax's own accumulators know nothing of the items behind each micro-batch:
``MEAN`` of per-micro-batch token means is the mean of means (F1). This one
takes ``(value, weight)`` pairs and keeps :mod:`optax_accum._core._window`'s
sums, ``sum_i w_i v_i`` and ``sum_i w_i``, with ``MultiSteps``' weight policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum._core import _reduction, _window

_LOCAL = _reduction.Local()  # optax.microbatch runs under plain jit: values are global.
_EXPECTED = (
  "Return (value, weight): value a tree of means over the micro-batch's items, "
  "weight their number (tokens, samples), one scalar. With jax.value_and_grad, "
  "return ((loss, grads), weight)."
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Carry:
  """The loop's carry: the window's sums, and the dtypes the result takes."""

  window: _window.Window  # sum_i w_i v_i (float32 at least) and sum_i w_i.
  negative: jax.Array  # int32 []: micro-batches whose weight was negative.
  # Each value leaf's dtype, in tree order, and the weight's.
  value_dtypes: tuple[Any, ...] = dataclasses.field(metadata={"static": True})
  weight_dtype: Any = dataclasses.field(metadata={"static": True})


def weighted_mean_accumulator() -> optax.microbatching.Accumulator:
  """An ``optax.microbatch`` accumulator: the weighted mean of ``(value, weight)``.

  The microbatched function returns, for each micro-batch, ``(value,
  weight)``: ``value`` a pytree of means over the micro-batch's items (a
  token-mean loss, its gradient) and ``weight`` their number, a scalar. The
  accumulator returns ``(sum_i w_i v_i / sum_i w_i, sum_i w_i)``, which is
  what the function returns on the whole batch. optax's ``MEAN`` returns
  ``sum_i v_i / k`` instead, equal only when every micro-batch has the same
  weight.

  - A micro-batch of weight 0 adds nothing, even a NaN value (its mean over
    no items is 0/0).
  - A batch of total weight 0 gives zeros and weight 0, never NaN: skip the
    update when the returned weight is 0.
  - A NaN or inf weight drops its micro-batch, as in
    :class:`optax_accum.MultiSteps`.
  - A negative weight makes the mean NaN, and the weight too where it is
    floating: no count of items is negative, so the function returned
    something else there, such as a gradient (``jax.value_and_grad`` output
    with no weight, for a scalar param). ``MultiSteps`` drops such a
    micro-batch and counts it in its state; this accumulator has no state to
    count it in, and dropping it alone would be silent.
  - The output's structure is checked when traced: ``weight`` must be one
    scalar, so ``(loss, grads)`` for array or pytree params is refused with
    the shape expected, ``((loss, grads), weight)``. For one scalar param,
    ``(loss, grad)`` has the shape of ``(value, weight)``: only a negative
    gradient shows, as above.
  - A NaN or inf value with positive weight makes the mean non-finite, as it
    would on the whole batch.
  - Sums are float32 at least (wider leaves keep their dtype); the mean comes
    back in each value leaf's dtype, the weight in its own.

  ``optax.microbatch`` also takes a tree of accumulators, a prefix of the
  function's output: ``(weighted_mean_accumulator(), AccumulationType.SUM)``
  for a function returning ``((value, weight), counts)``.

  Returns:
    An ``optax.microbatching.Accumulator`` (its ``aggregate`` serves
    ``optax.microbatching.micro_vmap``, with a weight per row).

  Examples:
    Two micro-batches of 2 and 1 items (``optax.microbatch`` gives micro-batch
    ``i`` the rows ``i, i + k, ...``):

    >>> import jax.numpy as jnp, optax, optax_accum
    >>> def mean_and_count(x, mask):
    ...   return (x * mask).sum() / mask.sum(), mask.sum()
    >>> x, mask = jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([1.0, 0.0, 1.0, 1.0])
    >>> mean, count = optax.microbatch(
    ...     mean_and_count, argnums=(0, 1), microbatch_size=2,
    ...     accumulator=optax_accum.weighted_mean_accumulator())(x, mask)
    >>> print(f"{mean:.4f} {count}  whole batch: {mean_and_count(x, mask)[0]:.4f}")
    2.6667 3.0  whole batch: 2.6667
    >>> mean, _ = optax.microbatch(
    ...     mean_and_count, argnums=(0, 1), microbatch_size=2,
    ...     accumulator=optax.microbatching.AccumulationType.MEAN)(x, mask)
    >>> print(f"optax MEAN: {mean:.4f}")
    optax MEAN: 3.0000
  """
  return optax.microbatching.Accumulator(
    init=_init, update=_update, finalize=_finalize, aggregate=_aggregate
  )


def _pair(output: Any) -> tuple[Any, Any]:
  """``output`` as ``(value, weight)``, or a ``ValueError`` that says so."""
  if not (isinstance(output, tuple | list) and len(output) == 2):
    raise ValueError(
      "weighted_mean_accumulator: the microbatched function must return "
      f"(value, weight), got {jax.tree.structure(output)}. {_EXPECTED}"
    )
  return output[0], output[1]


def _check_weight(weight: Any) -> None:
  """Raises ``ValueError`` unless ``weight`` is one scalar: a tree or an array
  there is most often the gradient of ``(loss, grads)``, returned unweighted."""
  leaves = jax.tree_util.tree_flatten_with_path(weight)[0]
  if len(leaves) == 1 and not leaves[0][0]:
    if np.shape(weight) == ():
      return
    got = f"shape {np.shape(weight)} as the output's second element: a gradient?"
  else:
    shapes = [f"{jax.tree_util.keystr(path)} {np.shape(x)}" for path, x in leaves]
    more = ", ..." if len(shapes) > 4 else ""
    listed = f"leaves {', '.join(shapes[:4])}{more}" if leaves else "no leaves"
    got = f"a tree with {listed} as the output's second element: gradients?"
  raise ValueError(
    f"weighted_mean_accumulator: `weight` must be a scalar, got {got} {_EXPECTED}"
  )


def _check_floating(value: Any) -> None:
  """Raises ``ValueError`` naming the first value leaf that is not floating."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise ValueError(
        f"weighted_mean_accumulator: value leaf {jax.tree_util.keystr(path)} has dtype "
        f"{leaf.dtype}; a weighted mean needs floating-point leaves. Give integer "
        "outputs their own accumulator (a tree such as (weighted_mean_accumulator(), "
        "AccumulationType.SUM)); for jax.value_and_grad(..., has_aux=True) output, "
        "((loss, weight), grads), return ((loss, grads), weight)."
      )


def _init(output_like: Any) -> _Carry:
  """Empty sums for an output shaped like ``output_like``."""
  value, weight = _pair(output_like)
  _check_weight(weight)
  _check_floating(value)
  dtypes = tuple(jnp.dtype(leaf.dtype) for leaf in jax.tree.leaves(value))
  negative, (window,) = jnp.zeros([], jnp.int32), _window.empty(value)
  return _Carry(window, negative, dtypes, jnp.dtype(weight.dtype))


def _update(carry: _Carry, output: Any, index: Any) -> _Carry:
  """``carry`` with one micro-batch's ``(value, weight)`` added."""
  value, weight = _pair(output)
  one = (carry.window,)
  admitted = _window.admit(one, (value,), (None,), (weight,), reduction=_LOCAL)
  (window,) = _window.add(one, (value,), (None,), admitted, reduction=_LOCAL)
  negative = carry.negative + (jnp.asarray(weight) < 0).astype(jnp.int32)
  return dataclasses.replace(carry, window=window, negative=negative)


def _finalize(carry: _Carry) -> tuple[Any, jax.Array]:
  """``(weighted mean, total weight)``; zeros where the total weight is 0, NaN
  after a negative weight."""
  window, total = carry.window, carry.window.acc_weight
  # Without weight nothing was added: the sums are zeros, and so is sum / 1.
  divisor = jnp.where(total > 0, total, jnp.ones_like(total))
  like = jax.tree.unflatten(jax.tree.structure(window.acc_grads), carry.value_dtypes)
  mean = _window.gradient((window._replace(acc_weight=divisor),), like)
  total = total.astype(carry.weight_dtype)
  return _poisoned(mean, carry.negative > 0), _poisoned(total, carry.negative > 0)


def _poisoned(tree: Any, bad: jax.Array) -> Any:
  """``tree`` with its floating leaves NaN where ``bad``; other leaves as they are."""

  def leaf(x: jax.Array) -> jax.Array:
    floating = jnp.issubdtype(x.dtype, jnp.inexact)
    return jnp.where(bad, jnp.full_like(x, jnp.nan), x) if floating else x

  return jax.tree.map(leaf, tree)


def _aggregate(rows: Any) -> tuple[Any, jax.Array]:
  """``(value, weight)`` pairs stacked along axis 0, as one pair: each row
  counts as a micro-batch of its own."""
  row_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), rows)
  empty = _init(row_like)
  per_row = jax.vmap(lambda row: _update(empty, row, 0))(rows)
  return _finalize(jax.tree.map(lambda x: jnp.sum(x, axis=0), per_row))

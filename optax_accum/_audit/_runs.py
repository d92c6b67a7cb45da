"""The runs ``audit`` compares: whole batch, its exact re-summation, and the setup."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum._core._backend import compiler_options

Path = tuple[str, ...]
GradFn = Callable[[Any, Any], tuple[Any, jax.Array]]


def _call(fn: Callable[..., Any], static: Any, *args: Any) -> Any:
  return fn(static, *args)


@functools.cache
def _jitted_call(options: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
  """``_call`` jitted with XLA ``options``: one cache for every audit."""
  return jax.jit(_call, static_argnums=(0, 1), compiler_options=dict(options) or None)


def compiled(fn: Callable[..., Any], static: Any) -> Callable[..., Any]:
  """``fn(static, *args)`` as a function of ``args``, compiled.

  Compiled once per ``static`` (every audit with the same loss or optimizer
  reuses the program) where it is hashable, else once per audit; either is far
  quicker than the many small programs ``fn`` compiles op by op outside
  ``jit``.
  """
  options = compiler_options()
  try:
    hash(static)
  except TypeError:
    return jax.jit(functools.partial(fn, static), compiler_options=options)
  call = _jitted_call(tuple(sorted((options or {}).items())))
  return functools.partial(call, fn, static)


def _grad(loss: Callable[..., Any], params: Any, batch: Any) -> tuple[Any, jax.Array]:
  return jax.grad(loss, has_aux=True)(params, batch)


def gradient_fn(loss: Callable[..., Any]) -> GradFn:
  """``(params, batch) -> (gradient, weight)`` of ``loss``, compiled."""
  return compiled(_grad, loss)


def _update(
  optimizer: optax.GradientTransformation,
  grads: Any,
  state: Any,
  params: Any,
  extra_args: dict[str, Any],
) -> tuple[Any, Any]:
  updates, state = optimizer.update(grads, state, params, **extra_args)
  return optax.apply_updates(params, updates), state


def update_fn(
  optimizer: optax.GradientTransformation,
) -> Callable[[Any, Any, Any, dict[str, Any]], tuple[Any, Any]]:
  """``(grads, state, params, extra_args) -> (params, state)``: one compiled update."""
  return compiled(_update, optimizer)


def f32(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def copy_arrays(tree: Any) -> Any:
  """A copy a donating step may consume without touching the caller's arrays."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def host_copy(tree: Any) -> Any:
  """``tree`` as NumPy copies: safe from a step that donates its buffers."""
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def differs(a: Any, b: Any) -> bool:
  return not all(
    np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def finite(tree: Any) -> bool:
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def _key_name(key: Any) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def named_leaves(tree: Any) -> list[tuple[Path, Any]]:
  """Every leaf with its path as plain names, whatever wraps the state.

  A NamedTuple field, a dict key and an index all become their name, and an
  ``nnx`` variable's trailing ``value`` is dropped, so an optimizer state reads
  the same inside ``optax.MultiSteps``, a tuple of the user's or an
  ``nnx.Optimizer``.
  """
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = tuple(_key_name(key) for key in path)
    if names and names[-1] in ("value", "raw_value"):
      names = names[:-1]
    out.append((names, leaf))
  return out


def _is_int_scalar(x: Any) -> bool:
  return np.ndim(x) == 0 and jnp.issubdtype(jnp.result_type(x), jnp.integer)


def learning_rate_paths(state: Any) -> list[Path]:
  """Paths of every injected learning rate, in tree order."""
  return [
    path
    for path, _ in named_leaves(state)
    if path[-2:] == ("hyperparams", "learning_rate")
  ]


def count_paths(state: Any) -> list[Path]:
  """Paths of every step count (``count`` fields of optax states)."""
  return [
    path
    for path, leaf in named_leaves(state)
    if path and path[-1] == "count" and _is_int_scalar(leaf)
  ]


def read_all(state: Any, paths: Sequence[Path]) -> dict[Path, list[float]]:
  """For each of ``paths``, the leaves of ``state`` whose path ends with it.

  A leaf that several of ``paths`` end (``hyperparams.learning_rate`` and
  ``inner_state.hyperparams.learning_rate``) goes to the longest.
  """
  out: dict[Path, list[float]] = {path: [] for path in paths}
  for names, leaf in named_leaves(state):
    matches = [path for path in paths if names[-len(path) :] == path]
    if matches:
      out[max(matches, key=len)].append(float(np.asarray(leaf)))
  return out


def summed(trees: Sequence[Any]) -> Any:
  """The sum of ``trees``, leaf by leaf."""
  return jax.tree.map(lambda *x: sum(x[1:], x[0]), *trees)


def recombined(grads: Sequence[Any], weights: Sequence[float], like: Any) -> Any:
  """``sum_i w_i g_i / sum_i w_i`` in float32, cast back to each leaf's dtype."""
  total = sum(weights)
  summed = jax.tree.map(
    lambda *g: (
      sum(w * x.astype(jnp.float32) for w, x in zip(weights, g, strict=True)) / total
    ),
    *grads,
  )
  return jax.tree.map(lambda s, p: s.astype(jnp.result_type(p)), summed, like)


@dataclasses.dataclass
class Reference:
  """A whole-batch run: the state after each update.

  Attributes:
    params: Params after each update.
    changed: Whether each update changed the params.
    moving: Whether each update's gradient is nonzero: whether a loop that
      applies the gradient itself changes the params there.
    learning_rates: Each injected learning rate after each update.
    counts: Each step count after each update.
    nonfinite_at: The first update (1-based) after which params are not
      finite, or ``None``.
    low_precision: Injected hyperparameters held below float32, by name, with
      their value there (``b2`` 0.999 is 1.0 in bfloat16).
  """

  params: list[Any]
  changed: list[bool]
  moving: list[bool]
  learning_rates: dict[Path, list[float]]
  counts: dict[Path, list[float]]
  nonfinite_at: int | None
  low_precision: dict[str, float]


def whole_batch_run(
  gradient: BatchGradient,
  optimizer: optax.GradientTransformation,
  params: Any,
  batches: Sequence[Any],
  micro: Sequence[Sequence[Any]],
  ends_windows: bool = False,
) -> Reference:
  """``optimizer`` once per batch, on ``gradient(params, batch, micro_batches)``
  (:func:`whole_gradient`, or :func:`resummed_gradient`: the same maths summed
  in another order, so how far apart the two end is rounding).

  With ``ends_windows`` each update passes ``end_window=True`` and the batch's
  weight, for an :class:`optax_accum.MultiSteps` inside ``optimizer``.
  """
  state = optimizer.init(params)
  update = update_fn(optimizer)
  lr_paths, counted = learning_rate_paths(state), count_paths(state)
  out = Reference([], [], [], {path: [] for path in lr_paths}, {}, None, {})
  out.counts = {path: [] for path in counted}
  for name, value in _hyperparams(state).items():
    if jnp.finfo(jnp.result_type(value)).bits < 32:
      out.low_precision[name] = float(np.asarray(value, np.float32))
  for i, batch in enumerate(batches):
    grads, weight = gradient(params, batch, micro[i])
    extra = {"end_window": True, "weight": weight} if ends_windows else {}
    new_params, state = update(grads, state, params, jax.tree.map(jnp.asarray, extra))
    out.changed.append(differs(new_params, params))
    out.moving.append(any(np.any(np.asarray(g)) for g in jax.tree.leaves(grads)))
    params = new_params
    out.params.append(params)
    values = dict(named_leaves(state))
    for path, series in [*out.learning_rates.items(), *out.counts.items()]:
      series.append(float(np.asarray(values[path])))
    if out.nonfinite_at is None and not finite(params):
      out.nonfinite_at = i + 1
  return out


#: ``gradient(params, batch, micro_batches) -> (gradient, weight)``: what the
#: whole batch applies in one update.
BatchGradient = Callable[[Any, Any, Sequence[Any]], tuple[Any, Any]]


def whole_gradient(grad_fn: GradFn) -> BatchGradient:
  """The batch's own gradient and weight."""

  def gradient(params: Any, batch: Any, micro: Sequence[Any]) -> tuple[Any, float]:
    del micro
    grads, weight = grad_fn(params, batch)
    return grads, float(weight)

  return gradient


def resummed_gradient(grad_fn: GradFn) -> BatchGradient:
  """The token-weighted sum of the batch's micro-batch gradients, and their
  total weight."""

  def gradient(params: Any, batch: Any, micro: Sequence[Any]) -> tuple[Any, float]:
    del batch
    pairs = [grad_fn(params, m) for m in micro]
    weights = [float(w) for _, w in pairs]
    return recombined([g for g, _ in pairs], weights, params), sum(weights)

  return gradient


def _hyperparams(state: Any) -> dict[str, Any]:
  return {
    path[-1]: leaf
    for path, leaf in named_leaves(state)
    if len(path) >= 2
    and path[-2] == "hyperparams"
    and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
  }


@dataclasses.dataclass
class LoopRun:
  """The setup over the audit's micro-steps: ``steps`` windows, then one
  micro-step, a restart, and ``2 k`` micro-steps more (two windows).

  Attributes:
    params: Params at each window end: ``steps`` before the restart, then two
      (after micro-steps ``k`` and ``2 k`` from the one before the restart).
    changed: For each micro-step before the restart, whether params changed.
    resumed: The same from the micro-step before the restart on (``2 k + 1``).
    learning_rates: The paths asked for, read at each of those window ends
      (each path may match several leaves, or none).
    counts: The count paths asked for, read after the ``steps`` windows.
    nonfinite_at: First micro-step (1-based, counting on through the restart)
      after which params are not finite, or ``None``.
  """

  params: list[Any]
  changed: list[bool]
  resumed: list[bool]
  learning_rates: dict[Path, list[list[float]]]
  counts: dict[Path, list[float]]
  nonfinite_at: int | None


def run_setup(
  accumulation: Callable[..., tuple[Callable, Callable]],
  optimizer: Any,
  k: int,
  params: Any,
  micro: Sequence[Sequence[Any]],
  lr_paths: Sequence[Path] = (),
  counted: Sequence[Path] = (),
  restart: bool = True,
) -> LoopRun:
  """Runs the setup over every window, then (``restart``) simulates a restart
  mid-window.

  The restart: one micro-step into the next window, the setup is built again
  (``accumulation(optimizer, k)``, as a restarted process would) and goes on
  from the params and state it had, over the micro-batches of the first two
  windows again. A setup whose own counters (outside its state) decide where
  windows end drifts by one micro-step there, as after a resumed run or a
  skipped bad batch.
  """
  init, step = accumulation(optimizer, k)
  current = copy_arrays(params)
  state = init(current)
  out = LoopRun([], [], [], {path: [] for path in lr_paths}, {}, None)
  flat = [m for window in micro for m in window]
  seen = host_copy(current)  # The params as the last step left them.

  def advance(step: Callable, micro_batch: Any, flags: list[bool]) -> None:
    nonlocal current, state, seen
    current, state = step(current, state, micro_batch)
    before, seen = seen, host_copy(current)
    flags.append(differs(seen, before))
    if out.nonfinite_at is None and not finite(seen):
      out.nonfinite_at = len(out.changed) + len(out.resumed)

  def window_end() -> None:
    out.params.append(seen)
    for path, values in read_all(state, lr_paths).items():
      out.learning_rates[path].append(values)

  for i, micro_batch in enumerate(flat):
    advance(step, micro_batch, out.changed)
    if i % k == k - 1:
      window_end()
  out.counts = read_all(state, counted)
  if not restart:
    return out
  advance(step, flat[0], out.resumed)
  _, step = accumulation(optimizer, k)
  for i in range(1, 2 * k + 1):
    advance(step, flat[i % len(flat)], out.resumed)
    if i % k == k - 1:
      window_end()
  return out

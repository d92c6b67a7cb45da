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

from optax_accum._audit_setups import strip_aux

Path = tuple[str, ...]

#: The optimizer the gradient probe runs: params move by exactly the gradient.
PROBE_OPTIMIZER = optax.sgd(1.0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compiled_grad(
  loss_fn: Callable[..., Any], has_aux: bool, params: Any, batch: Any
) -> tuple[Any, jax.Array]:
  return jax.grad(strip_aux(loss_fn, has_aux), has_aux=True)(params, batch)


GradFn = Callable[[Any, Any], tuple[Any, jax.Array]]


def gradient_fn(loss_fn: Callable[..., Any], has_aux: bool) -> GradFn:
  """``(params, batch) -> (mean-loss gradient, weight)``, compiled.

  Compiled once per ``loss_fn`` (every audit of the same loss reuses it) where
  ``loss_fn`` is hashable, else once per audit.
  """
  try:
    hash(loss_fn)
  except TypeError:
    return jax.jit(jax.grad(strip_aux(loss_fn, has_aux), has_aux=True))
  return functools.partial(_compiled_grad, loss_fn, has_aux)


def _update(
  optimizer: optax.GradientTransformation, grads: Any, state: Any, params: Any
) -> tuple[Any, Any]:
  updates, state = optimizer.update(grads, state, params)
  return optax.apply_updates(params, updates), state


_compiled_update = jax.jit(_update, static_argnums=0)


def update_fn(
  optimizer: optax.GradientTransformation,
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """``(grads, state, params) -> (params, state)``: one compiled update.

  Compiled once per optimizer where it is hashable (every audit with it
  reuses the program), else once per audit; either is far quicker than the
  many small programs the same update compiles op by op outside ``jit``.
  """
  try:
    hash(optimizer)
  except TypeError:
    return jax.jit(functools.partial(_update, optimizer))
  return functools.partial(_compiled_update, optimizer)


def f32(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def copy_arrays(tree: Any) -> Any:
  """A copy a donating step may consume without touching the caller's arrays."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def differs(a: Any, b: Any) -> bool:
  return not all(
    np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def finite(tree: Any) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(f32(tree)))


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


def read(state: Any, path: Path) -> float:
  """The value of the leaf of ``state`` at exactly ``path``."""
  return next(float(np.asarray(x)) for names, x in named_leaves(state) if names == path)


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
    learning_rates: Each injected learning rate after each update.
    counts: Each step count after the last update.
    nonfinite_at: The first update (1-based) after which params are not
      finite, or ``None``.
    low_precision: Injected hyperparameters held below float32, by name, with
      their value there (``b2`` 0.999 is 1.0 in bfloat16).
  """

  params: list[Any]
  changed: list[bool]
  learning_rates: dict[Path, list[float]]
  counts: dict[Path, list[float]]
  nonfinite_at: int | None
  low_precision: dict[str, float]


def whole_batch_run(
  grad_fn: GradFn,
  optimizer: optax.GradientTransformation,
  params: Any,
  batches: Sequence[Any],
  micro: Sequence[Sequence[Any]] | None = None,
) -> Reference:
  """``optimizer`` once per batch; with ``micro``, on the token-weighted sum of
  the micro-batch gradients instead of the batch's own gradient (the same
  maths, summed in another order: how far apart the two end is rounding).
  """
  state = optimizer.init(params)
  update = update_fn(optimizer)
  lr_paths = learning_rate_paths(state)
  out = Reference([], [], {path: [] for path in lr_paths}, {}, None, {})
  for name, value in _hyperparams(state).items():
    if jnp.finfo(jnp.result_type(value)).bits < 32:
      out.low_precision[name] = float(np.asarray(value, np.float32))
  for i, batch in enumerate(batches):
    if micro is None:
      grads, _ = grad_fn(params, batch)
    else:
      pairs = [grad_fn(params, m) for m in micro[i]]
      grads = recombined([g for g, _ in pairs], [float(w) for _, w in pairs], params)
    new_params, state = update(grads, state, params)
    out.changed.append(differs(new_params, params))
    params = new_params
    out.params.append(params)
    for path in lr_paths:
      out.learning_rates[path].append(read(state, path))
    if out.nonfinite_at is None and not finite(params):
      out.nonfinite_at = i + 1
  out.counts = {path: [read(state, path)] for path in count_paths(state)}
  return out


def _hyperparams(state: Any) -> dict[str, Any]:
  return {
    path[-1]: leaf
    for path, leaf in named_leaves(state)
    if len(path) >= 2
    and path[-2] == "hyperparams"
    and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
  }


@dataclasses.dataclass
class SetupRun:
  """The setup around the real optimizer, then a resume one micro-step in.

  Attributes:
    params: Params at each window end.
    changed: For each micro-step, whether params changed.
    learning_rates: The reference's learning-rate paths, read at each window
      end (each path may match several leaves, or none).
    counts: The reference's count paths, read after the last window.
    nonfinite_at: First micro-step (1-based) after which params are not
      finite, or ``None``.
    resumed: Whether params changed on the micro-step before the resume and on
      each one after it.
  """

  params: list[Any]
  changed: list[bool]
  learning_rates: dict[Path, list[list[float]]]
  counts: dict[Path, list[float]]
  nonfinite_at: int | None
  resumed: list[bool]


def setup_run(
  accumulation: Callable[..., tuple[Callable, Callable]],
  optimizer: Any,
  k: int,
  params: Any,
  micro: Sequence[Sequence[Any]],
  reference: Reference,
  resume: bool,
) -> SetupRun:
  """Runs the setup over every window, then simulates a restart mid-window.

  The restart: one micro-step into the next window, the setup is built again
  (``accumulation(optimizer, k)``, as a restarted process would) and goes on
  from the params and state it had; ``2 k`` more micro-steps follow. A setup
  whose own counters (outside its state) decide where windows end drifts by
  one micro-step there, as after a resumed run or a skipped bad batch.
  """
  init, step = accumulation(optimizer, k)
  current = copy_arrays(params)
  state = init(current)
  out = SetupRun([], [], {path: [] for path in reference.learning_rates}, {}, None, [])

  def advance(step: Callable, micro_batch: Any) -> bool:
    nonlocal current, state
    before = copy_arrays(current)
    current, state = step(current, state, micro_batch)
    return differs(current, before)

  for window in micro:
    for micro_batch in window:
      out.changed.append(advance(step, micro_batch))
      if out.nonfinite_at is None and not finite(current):
        out.nonfinite_at = len(out.changed)
    out.params.append(copy_arrays(current))
    learning_rates = read_all(state, list(out.learning_rates))
    for path, values in learning_rates.items():
      out.learning_rates[path].append(values)
  out.counts = read_all(state, list(reference.counts))
  if resume:
    flat = [m for window in micro for m in window]
    out.resumed.append(advance(step, flat[0]))
    _, step = accumulation(optimizer, k)
    for i in range(1, 2 * k + 1):
      out.resumed.append(advance(step, flat[i % len(flat)]))
  return out


@dataclasses.dataclass
class Probe:
  """The first window through the setup around ``optax.sgd(1.0)``.

  Attributes:
    applied: The gradient the setup applied (float32 params before minus after).
    changed: For each micro-step, whether params changed.
  """

  applied: Any
  changed: list[bool]


def gradient_probe(
  accumulation: Callable[..., tuple[Callable, Callable]],
  k: int,
  params32: Any,
  window: Sequence[Any],
) -> Probe:
  init, step = accumulation(PROBE_OPTIMIZER, k)
  current = copy_arrays(params32)
  state = init(current)
  changed = []
  for micro_batch in window:
    before = copy_arrays(current)
    current, state = step(current, state, micro_batch)
    changed.append(differs(current, before))
  return Probe(jax.tree.map(jnp.subtract, params32, f32(current)), changed)

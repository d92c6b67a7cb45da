"""State transitions of a ``MultiStepsState``: one micro-batch in, a window out.

Shared by :meth:`optax_accum.MultiSteps.update` and the train step's programs,
each with its own reduction policy: the window arithmetic plus the counters,
``should_skip_update_fn`` and the inner optimizer's call.
"""

from __future__ import annotations

import difflib
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from optax_accum._core import _checks, _hyperparams, _noise, _state, _window
from optax_accum._core._state import WINDOW_MICRO_STEPS, WINDOW_WEIGHT

#: Short names for the signatures.
Config = _state.MultiStepsConfig
State = _state.MultiStepsState

#: The states of optax's line searches, which pass extra arguments to ``value_fn``.
_SEARCHES = (optax.ScaleByZoomLinesearchState, optax.ScaleByBacktrackingLinesearchState)

#: What ``updates`` must match, as a mismatch's error names it.
_ACC_NAME = (
  "the accumulator (from init(params); a train step's state, per replica, goes "
  "back to that step)"
)


def window_of(config: Config, state: State) -> _window.Terms:
  """The window in progress of a state, one window per loss term."""
  noise = state.noise_scale if config.noise_scale else None
  fields = (state.mini_step, state.acc_grads, state.acc_weight, state.acc_loss, noise)
  return _window.per_term_windows(_window.Window(*fields), config.terms)


def empty_window(config: Config, params: Any) -> _window.Terms:
  """An empty window for ``params`` (sums in the accumulator dtype, a term each)."""
  return _window.empty(params, config.accumulator_dtype, config.terms)


def with_window(config: Config, state: State, window: _window.Terms) -> State:
  """``state`` holding ``window``; without noise measurements, keeps the state's."""
  fields = _window.as_state_fields(window, config.terms)._asdict()
  if fields["noise_scale"] is None:
    del fields["noise_scale"]
  return state._replace(**fields)


def _screened(
  config: Config, state: State, grads: Any, weight: Any, params: Any, reduction: Any
) -> tuple[jax.Array, Any]:
  """Whether ``should_skip_update_fn`` lets the micro-batch count, and its state:
  it sees the micro-batch's gradient over all replicas as one device computes it
  (means averaged by the replicas' weights, NaN for a non-finite weight: one more
  gradient reduction per micro-batch), one replica's rejection rejects on all,
  and ``skip_state`` is its leaves' maximum over the replicas."""
  if config.should_skip_update_fn is None:
    return jnp.array(True), state.skip_state
  if not reduction.axes:
    whole = reduction.window_gradient(grads)
  else:
    dtype = jnp.result_type(jax.tree.leaves(state.acc_weight)[0])
    terms = zip(*_per_term(config, grads, weight, None)[:2], strict=True)
    each = tuple(_whole(config, g, w, dtype, reduction) for g, w in terms)
    whole = _window.stored(each, config.terms)
  skip, skip_state = config.should_skip_update_fn(whole, state.gradient_step, params)
  if (jnp.result_type(skip), jnp.shape(skip)) != (jnp.bool_, ()):
    raise ValueError(
      "`should_skip_update_fn` must return a bool scalar, got dtype "
      f"{jnp.result_type(skip)} and shape {jnp.shape(skip)}."
    )
  skip = reduction.sum(jnp.asarray(skip).astype(jnp.int32)) > 0
  return ~skip, reduction.agree(skip_state)


def _whole(config: Config, grads: Any, weight: Any, dtype: Any, reduction: Any) -> Any:
  """One term's gradient over replicas, as :func:`_screened` shows it."""
  if config.grad_reduction != "mean":
    return jax.tree.map(reduction.sum, grads)
  w = reduction.own(_checks.scalar(weight, name="weight", dtype=dtype))
  total = reduction.sum(jnp.where(jnp.isfinite(w) & (w > 0), w, jnp.zeros_like(w)))
  # A replica of weight 0 or below adds nothing; one of a non-finite weight
  # adds NaN, as its gradient is on one device.
  w = jnp.where((w > 0) | ~jnp.isfinite(w), w, jnp.zeros_like(w))
  return jax.tree.map(lambda x: _mean_of(x, w, total, reduction), grads)


def _mean_of(x: Any, w: jax.Array, total: jax.Array, reduction: Any) -> jax.Array:
  """``x``'s mean over the replicas weighted by ``w`` (``total`` their sum), or
  ``x`` itself if JAX summed it already (adding it raises the error)."""
  x = jnp.asarray(x)
  if reduction.summed_already(x):
    return x
  wide = _window.accumulator_dtype(x.dtype, None)
  term = x.astype(wide) * w.astype(wide)
  term = jnp.where(w != 0, term, jnp.zeros_like(term))
  total = total.astype(wide)
  mean = reduction.sum(term) / jnp.where(total > 0, total, jnp.ones_like(total))
  return mean.astype(x.dtype)


def add_micro_batch(
  config: Config,
  state: State,
  grads: Any,
  params: Any = None,
  *,
  weight: Any,
  loss: Any,
  reduction: Any,
) -> tuple[State, jax.Array]:
  """``state`` with a micro-batch added (the window not ended), and whether it
  counts towards ``k``. With terms, values are by term (:func:`by_term`)."""
  if config.terms is not None:
    grads = by_term(config.terms, grads, "updates")
  _checks.check_tree_matches(grads, state.acc_grads, name="updates", ref_name=_ACC_NAME)
  if config.noise_scale and not _noise.measures(state.noise_scale):
    raise ValueError(
      "This MultiSteps measures the noise scale (noise_scale=True) but `state` has no "
      "noise_scale field (from an accumulator without it, or restored from such a "
      "checkpoint). Start measuring at a window's start (state.mini_step 0; mid-window "
      "the window's first micro-batches would be missing from its sums) with "
      "state._replace(noise_scale=opt.init(params).noise_scale)."
    )
  counted, skip_state = _screened(config, state, grads, weight, params, reduction)
  grads, weight, loss = _per_term(config, grads, weight, loss)
  window = window_of(config, state)
  drop = config.on_nonfinite == "skip_micro_batch"
  policy = dict(reduction=reduction, counted=counted, drop_nonfinite=drop)
  admitted = _window.admit(window, grads, loss, weight, **policy)
  weigh = config.grad_reduction == "mean"
  window = _window.add(window, grads, loss, admitted, reduction=reduction, weigh=weigh)
  dropped = admitted[0].dropped  # By its weight or its values, in every term.
  if config.grad_reduction == "window_mean":  # Shares of the whole window's mean.
    window = _window.spoil(window, dropped)
  seen = jnp.asarray(state.micro_batches_seen, jnp.int32)
  added = with_window(config, state, window)._replace(
    updated=jnp.zeros_like(state.updated),
    skipped_micro_batches=_count_if(dropped, state.skipped_micro_batches),
    skip_state=skip_state,
    micro_batches_seen=optax.safe_increment(seen),
  )
  return added, counted


def _per_term(
  config: Config, grads: Any, weight: Any, loss: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
  """The micro-batch's grads (by term already), weight and loss, one per term."""
  if (names := config.terms) is not None:
    losses = (None,) * len(names) if loss is None else by_term(names, loss, "loss")
    return grads, by_term(names, weight, "weight"), losses
  if weight is None and config.grad_reduction == "sum":
    raise ValueError(
      "`weight` is required with grad_reduction='sum': the number of "
      "items behind each summed-loss gradient normalises the window."
    )
  return (grads,), (1 if weight is None else weight,), (loss,)


def by_term(names: tuple[str, ...], values: Any, what: str) -> tuple[Any, ...]:
  """``values`` (a dict by term name, or a tuple) in ``names``' order."""
  if isinstance(values, tuple) and len(values) == len(names):
    return values
  if not isinstance(values, dict) or set(values) != set(names):
    got = sorted(values) if isinstance(values, dict) else type(values).__name__
    raise ValueError(
      f"`{what}` must be a dict with one entry per loss term {list(names)} "
      f"(MultiSteps(terms=...)), got {got}."
    )
  return tuple(values[name] for name in names)


def full(micro_steps: Any, k: Any) -> Any:
  """Whether a window of ``micro_steps`` counted micro-batches is full: the one
  rule of a window's end, for the programs' counters and the host's ints alike.

  Examples:
    >>> full(3, 4), full(4, 4)
    (False, True)
  """
  return micro_steps >= k


def window_ends(
  config: Config, added: State, counted: ArrayLike, end_window: ArrayLike | None = None
) -> jax.Array:
  """Whether the micro-batch just added ends the window."""
  ends = jnp.asarray(counted) & full(added.mini_step, config.k_at(added.gradient_step))
  if end_window is not None:
    ends = ends | _checks.scalar(end_window, name="end_window", dtype=jnp.bool_)
  return ends


def run_inner(
  config: Config,
  opt: optax.GradientTransformationExtraArgs,
  grads: Any,
  added: State,
  params: Any,
  extra_args: dict[str, Any],
) -> tuple[Any, Any]:
  """The inner optimizer's update on a window's gradient, its state's dtypes kept;
  the window's totals go as extra arguments, except to a line search, which would
  hand them on to a ``value_fn`` that does not take them."""
  inner_state = added.inner_opt_state
  if not _hyperparams.find_states(inner_state, _SEARCHES):
    weight, steps = _window.weight(window_of(config, added)), added.mini_step
    extra_args = {**extra_args, WINDOW_WEIGHT: weight, WINDOW_MICRO_STEPS: steps}
  updates, inner = opt.update(grads, inner_state, params, **extra_args)
  cast = lambda new, old: jnp.asarray(new).astype(jnp.result_type(old))  # noqa: E731
  return updates, jax.tree.map(cast, inner, inner_state)


def closed(
  config: Config,
  added: State,
  ends: jax.Array,
  nonfinite: jax.Array,
  applies: jax.Array,
  inner_opt_state: Any,
  *,
  divided_loss: jax.Array,
  squares: jax.Array,
) -> State:
  """The state after the window's end (where ``ends``); ``divided_loss`` is its
  :meth:`MultiSteps.window_loss`, ``squares`` its gradient's squared norm."""
  window = window_of(config, added)
  noise, weight = added.noise_scale, _window.weight(window)
  if config.noise_scale:
    if not config.divides and config.grad_reduction != "window_mean":
      squares = squares / jnp.where(weight > 0, weight * weight, 1)  # Of the mean.
    noise = _noise.closed(noise, squares, weight, ends, applies, config.grad_reduction)
  return with_window(config, added, _window.reset(window, ends))._replace(
    noise_scale=noise,
    gradient_step=_count_if(applies, added.gradient_step),
    inner_opt_state=inner_opt_state,
    updated=applies,
    skipped_windows=_count_if(nonfinite, added.skipped_windows),
    last_window_loss=_kept_unless(ends, divided_loss, added.last_window_loss),
    last_window_weight=_kept_unless(ends, weight, added.last_window_weight),
  )


def _count_if(flag: jax.Array, counter: jax.Array) -> jax.Array:
  return jnp.where(flag, optax.safe_increment(counter), counter)


def _kept_unless(ends: jax.Array, new: jax.Array, old: ArrayLike) -> jax.Array:
  """``new`` if ``ends`` else ``old`` (cast to ``new``'s dtype)."""
  return jnp.where(ends, new, jnp.asarray(old).astype(new.dtype))


def check_extra_args(extra_args: dict[str, Any], loss: Any) -> None:
  """Refuses extra arguments the accumulator sets itself, or typos of its own."""
  for name in extra_args:
    close = difflib.get_close_matches(name, ("weight", "loss", "end_window"), 1, 0.8)
    if close:
      raise ValueError(
        f"`{name}=` is not an argument of MultiSteps.update: did you mean "
        f"`{close[0]}=`? Other keyword arguments go to the inner optimizer, "
        "which ignores names it does not take."
      )
  if reserved := [n for n in (WINDOW_WEIGHT, WINDOW_MICRO_STEPS) if n in extra_args]:
    raise ValueError(
      f"`{reserved[0]}` is reserved: MultiSteps passes the window's totals to the "
      "inner optimizer itself."
    )
  if loss is not None and "value" in extra_args:
    raise ValueError(
      "Pass `loss=` or `value=`, not both: with `loss=` the inner optimizer "
      "(optax.contrib.reduce_on_plateau) gets the window's loss as `value`."
    )

"""Token-weighted gradient accumulation: a drop-in for ``optax.MultiSteps``.

:class:`MultiSteps` adapts to optax the window arithmetic (``_window``), the
reduction policy (``_reduction``) and the state transitions (``_transitions``)
that it shares with ``make_train_step``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike, DTypeLike

from optax_accum._core import (
  _checks,
  _ending,
  _noise,
  _placement,
  _reduction,
  _state,
  _transitions,
  _window,
)
from optax_accum._core._state import (
  WINDOW_MICRO_STEPS,
  WINDOW_WEIGHT,
  EveryKSchedule,
  MultiStepsConfig,
  MultiStepsState,
)

#: How the warning for an update without ``weight=`` starts (to filter it).
NO_WEIGHT = "MultiSteps.update got no `weight=`"
#: The warning itself (a UserWarning).
_UNWEIGHTED = (
  f"{NO_WEIGHT}: every micro-batch weighs 1, so a window's gradient is the uniform "
  "mean of micro-batch gradients (optax.MultiSteps' behaviour), the whole batch's "
  "only when every micro-batch's loss divides by the same count. Pass weight=<the "
  "count your loss divides by>: valid tokens for a token mean, rows for a mean of "
  "per-row means, rows x length for a mean over all positions; for a loss divided by "
  "a constant or not at all, build MultiSteps(..., grad_reduction='window_mean'). "
  "weight=1 asks for the uniform mean without this warning (docs/multi_steps.md, "
  "'The weight'). Flax's own TrainState.apply_gradients cannot pass a weight: "
  "use optax_accum.flax.TrainState."
)

__all__ = [
  "WINDOW_MICRO_STEPS",
  "WINDOW_WEIGHT",
  "EveryKSchedule",
  "MultiSteps",
  "MultiStepsConfig",
  "MultiStepsState",
]


class _OwnTransformation(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` whose ``init`` and ``update``
  are its own methods, so ``optax.chain`` unpacks and calls them with the
  extra arguments; a pytree without leaves, as a transformation is."""

  def __new__(cls, *args: Any, **kwargs: Any) -> Any:
    self: Any = super().__new__(  # (init, update): the instance's methods
      cls, lambda params: self.init(params), lambda *a, **kw: self.update(*a, **kw)
    )
    return self

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    jax.tree_util.register_pytree_node(cls, lambda tx: ((), tx), lambda tx, _: tx)

  def __repr__(self) -> str:
    public = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k[0] != "_")
    return f"{type(self).__name__}({public})"

  def _replace(self, **changes: Any) -> Any:
    """Refused: the tuple optax unpacks is derived; use ``replace``."""
    raise TypeError(
      f"{type(self).__name__}._replace({', '.join(changes)}): use "
      f"{type(self).__name__}.replace(...) with constructor arguments."
    )


class MultiSteps(_OwnTransformation):
  r"""Accumulates gradients over a window of micro-batches, weighted by items.

  A drop-in for :class:`optax.MultiSteps` that gives exactly the whole-batch
  gradient when micro-batches hold different numbers of items (tokens,
  samples). Each call passes one micro-batch's gradient :math:`g_i` of its
  loss and its ``weight`` :math:`w_i`, the count that loss divides by
  (``docs/multi_steps.md``); the window's last call runs the inner optimizer on

  .. math::
    g = \frac{\sum_i w_i\, g_i}{\sum_i w_i}

  with the window's totals as extra arguments ``window_weight`` and
  ``window_micro_steps``; every other call returns exact zeros. Without
  ``weight`` every micro-batch weighs 1, as in ``optax.MultiSteps``, and the
  first such call warns once (``weight=1`` asks for it silently). What each
  kind of micro-batch (padding only, a bad weight, a non-finite gradient)
  does to the window is in ``docs/multi_steps.md``.

  :meth:`init` lays the sums out as the params (one sum), as a train step's
  ``step.init`` does on one device; every call returns the layout it was given.

  Args:
    opt: The optimizer to run once per window.
    every_k_schedule: Micro-batches per window: an int ``>= 1``, or a callable
      of the update count (int32 ``[]``) returning one (cast to int32). A
      value below 1 returned at run time is treated as 1. ``"end_window"``:
      no count ends a window, only a call with ``end_window=True`` does
      (dynamic batching, where the caller knows where each window ends).
    use_grad_mean: If ``True`` (default) the emitted gradient is divided by
      the window's total weight; otherwise it is the weighted sum. No effect
      with ``grad_reduction="window_mean"``, whose sum is already the mean.
    should_skip_update_fn: Optional ``fn(updates, gradient_step, params) ->
      (skip, skip_state)`` as in optax; a skipped micro-batch is as if it never
      happened (only ``skip_state`` changes), except that ``end_window=True``
      on it still ends the window.
    accumulator_dtype: Dtype of the accumulator. ``None`` (default) uses
      float32, or the leaf's own dtype where that is wider (float64). A
      narrower one (bfloat16, float16) stores the running sum only: weights
      and ``weight * grad`` stay float32, and each add rounds once.
    grad_reduction: How the caller reduced each micro-batch's loss over its
      items: ``"mean"`` (default) or ``"sum"``. ``"sum"`` requires ``weight``.
      ``"window_mean"``: summed, then divided by the whole window's item
      count known beforehand (Hugging Face's ``num_items_in_batch``): the
      shares are summed as they are, ``weight`` (default 1) only counts
      items, and no micro-batch can be dropped alone (``skip_micro_batch``
      is refused; a bad ``weight`` drops its window).
    axis_name: Inside ``shard_map`` or ``pmap``: the data-parallel mesh axis
      (or axes) to sum weights, weighted gradients and losses over, so each
      window's gradient is the token mean over all replicas. Not needed under
      ``jit`` with sharded arrays, where gradients are global (and
      :func:`make_train_step` sums them once per window on an Explicit mesh).
      Under manual axes without it, a ``weight`` that may differ per replica
      is a ``ValueError`` (the replicas would drift apart); ``()`` says they
      are independent on purpose.
    on_nonfinite: What a non-finite (NaN or infinite) gradient or loss in a
      micro-batch with positive weight does: ``"skip_window"`` (default) drops
      its whole window atomically when the window ends; ``"skip_micro_batch"``
      drops only that micro-batch (one more check per micro-batch) and keeps
      the window. Either way the state counts what was dropped.
    terms: Names of loss terms that each keep their own weight over the
      window (``docs/loss_terms.md``): ``updates``, ``weight`` and ``loss``
      are dicts by term name; the window's gradient is ``sum_t A_t / W_t``,
      one accumulator per term; ``window_weight`` is the first term's.
    noise_scale: Measure each window's gradient noise scale, unbiased
      :math:`|\mu|^2` and :math:`\operatorname{tr}\Sigma` in the state
      (``docs/noise_scale.md``); one more squared norm a micro-batch.

  Examples:
    Two micro-batches with 1 and 3 tokens: the emitted gradient is the token
    mean, not the mean of the two micro-batch means (which would be 2.0).

    >>> import jax.numpy as jnp, optax, optax_accum
    >>> opt = optax_accum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    >>> state = opt.init(jnp.zeros(()))
    >>> u, state = opt.update(jnp.array(1.0), state, weight=1)
    >>> u, opt.has_updated(state)
    (Array(0., dtype=float32), Array(False, dtype=bool))
    >>> u, state = opt.update(jnp.array(3.0), state, weight=3)
    >>> u, opt.has_updated(state)   # -(1*1 + 3*3) / (1 + 3)
    (Array(-2.5, dtype=float32), Array(True, dtype=bool))

  It is an ``optax.GradientTransformationExtraArgs``, so inside
  ``optax.chain`` it still gets ``weight=`` and the other keyword arguments.

  References:
    Unsloth, `Bug fixes in gradient accumulation
    <https://unsloth.ai/blog/gradient>`_, 2024.
  """

  def __init__(
    self,
    opt: optax.GradientTransformation,
    every_k_schedule: EveryKSchedule,
    use_grad_mean: bool = True,
    should_skip_update_fn: _state.ShouldSkipUpdateFn | None = None,
    accumulator_dtype: DTypeLike | None = None,
    *,
    grad_reduction: _state.GradReduction = "mean",
    axis_name: _reduction.AxisName | None = None,
    on_nonfinite: _state.NonFinitePolicy = "skip_window",
    terms: tuple[str, ...] | None = None,
    noise_scale: bool = False,
  ):
    if not (hasattr(opt, "init") and hasattr(opt, "update")):
      raise ValueError(
        f"`opt` must be an optax.GradientTransformation, got {type(opt).__name__}."
      )
    args = (every_k_schedule, use_grad_mean, should_skip_update_fn, accumulator_dtype)
    self.config = MultiStepsConfig(
      *args, grad_reduction, axis_name, on_nonfinite, terms, noise_scale
    )
    self._given_opt, self._opt = opt, optax.with_extra_args_support(opt)
    # Says once, when traced, that no weight means optax's mean (a window_mean
    # sum needs no weight).
    self._warns = self.config.grad_reduction != "window_mean"

  def replace(self, **changes: Any) -> MultiSteps:
    """A copy with some constructor arguments changed (``opt=`` included).

    Examples:
      >>> import optax, optax_accum
      >>> acc = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
      >>> acc.replace(opt=optax.adam(1e-3)).k_at(0)
      Array(4, dtype=int32)
    """
    opt = changes.pop("opt", self._given_opt)
    return MultiSteps(opt, **{**dataclasses.asdict(self.config), **changes})

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer (with extra-args support)."""
    return self._opt

  def k_at(self, update_count: ArrayLike) -> jax.Array:
    """Micro-batches per window after ``update_count`` updates (int32, >= 1)."""
    return self.config.k_at(update_count)

  @property
  def axis_name(self) -> _reduction.AxisName | None:
    """The mesh axis (or axes) weights and gradients are summed over, if any."""
    return self.config.axis_name

  @property
  def grad_reduction(self) -> _state.GradReduction:
    """How the caller reduces each micro-batch's loss over its items."""
    return self.config.grad_reduction

  @property
  def on_nonfinite(self) -> _state.NonFinitePolicy:
    """What a non-finite gradient drops: its micro-batch or its whole window."""
    return self.config.on_nonfinite

  def window_loss(self, state: MultiStepsState) -> jax.Array:
    """The loss of the window so far, from the ``loss=`` of its micro-batches.

    ``acc_loss / acc_weight``, the token mean (0 while the window has no
    weight); with ``grad_reduction="window_mean"``, ``acc_loss`` itself (the
    sum of the shares so far: the window's mean once it is complete). For the
    window that ended last, read ``state.last_window_loss``.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
      >>> state = opt.init(jnp.zeros(()))
      >>> _, state = opt.update(jnp.array(1.0), state, weight=1, loss=4.0)
      >>> float(opt.window_loss(state))
      4.0
      >>> _, state = opt.update(jnp.array(1.0), state, weight=3, loss=2.0)
      >>> float(opt.window_loss(state)), float(state.last_window_loss)
      (0.0, 2.5)
    """
    shares = self.config.grad_reduction == "window_mean"
    return _window.mean_loss(_transitions.window_of(self.config, state), shares=shares)

  def init(self, params: optax.Params) -> MultiStepsState:
    """Returns the state for a fresh run: an empty window and no updates.

    Where ``params`` are committed to one device (``jax.device_put(params,
    device)``), so is the state, as a jitted step returns it: a step in your
    ``jit`` then compiles once, not again on its second call."""
    _checks.check_trainable_leaves(params, name="params")
    window = _transitions.empty_window(self.config, params)
    gradient_step, skip_state = jnp.zeros([], jnp.int32), ()
    if (skip_fn := self.config.should_skip_update_fn) is not None:
      zeros = jax.tree.map(jnp.zeros_like, params)
      _, skip_state = skip_fn(zeros, gradient_step, params)
    _state.check_single_accumulation(inner_opt_state := self._opt.init(params))
    count, weight = jnp.int32, _window.weight(window).dtype  # A buffer per field:
    fields = _window.as_state_fields(window, self.config.terms)._asdict()
    if self.config.noise_scale:
      fields["noise_scale"] = _noise.empty(weight)
    state = MultiStepsState(  # a state is donated leaf by leaf.
      **fields,
      gradient_step=gradient_step,
      inner_opt_state=inner_opt_state,
      updated=jnp.zeros([], jnp.bool_),
      skipped_micro_batches=jnp.zeros([], count),
      skipped_windows=jnp.zeros([], count),
      skip_state=skip_state,
      micro_batches_seen=jnp.zeros([], count),
      last_window_loss=jnp.zeros([], weight),
      last_window_weight=jnp.zeros([], weight),
    )
    return _placement.committed(state, params)

  def update(
    self,
    updates: optax.Updates,
    state: MultiStepsState,
    params: optax.Params | None = None,
    *,
    weight: ArrayLike | dict[str, ArrayLike] | None = None,
    end_window: ArrayLike | None = None,
    loss: ArrayLike | dict[str, ArrayLike] | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, MultiStepsState]:
    """Adds one micro-batch to the window; runs the optimizer if it ends it.

    Args:
      updates: The micro-batch's gradient, a tree like params. With
        ``terms``, ``updates``, ``weight`` and ``loss`` are dicts by term name,
        each entry a term's gradient, weight and loss.
      state: The current state.
      params: Current params, forwarded to the inner optimizer.
      weight: The count the loss divides by, traced or not (tokens for a token
        mean, rows for a mean of row means: ``docs/multi_steps.md``); needed
        with ``terms`` and ``"sum"``; left out, 1 (optax's mean), warning once.
      end_window: Optional bool scalar, traced or not: end the window with this
        micro-batch even if it holds fewer than ``k`` micro-batches.
      loss: Optional loss of the micro-batch, reduced like its gradient; the
        state's ``acc_loss`` then sums it into the window's loss, the inner
        optimizer gets that loss (:meth:`window_loss`) as the extra argument
        ``value`` (what ``optax.contrib.reduce_on_plateau`` reads), and
        ``last_window_loss`` keeps it after the window ends.
      **extra_args: Forwarded to the inner optimizer's update. A name close to
        one of this method's own (``weights=``) is a ``ValueError``.

    Returns:
      The inner optimizer's updates on the call that ends a window with
      positive weight, exact zeros on every other call; and the new state.
    """
    _transitions.check_extra_args(extra_args, loss)
    _state.check_not_holding(state, "MultiSteps.update")
    if weight is None and self._warns:
      self._warns = False
      warnings.warn(_UNWEIGHTED, stacklevel=2)  # Where update was called.
    _reduction.check_replicas(self.config.axis_name, weight)
    _state.check_one_sum(state.acc_grads, "MultiSteps.update")
    reduction = _reduction.policy(self.config.axis_name)
    added, counted = _transitions.add_micro_batch(
      self.config, state, updates, params, weight=weight, loss=loss, reduction=reduction
    )
    ends = _transitions.window_ends(self.config, added, counted, end_window)
    sums, window_loss = added.acc_grads, self.window_loss(added)
    if loss is not None:
      extra_args = {**extra_args, "value": window_loss}
    like = updates
    if (terms := self.config.terms) is not None:
      like = _transitions.by_term(terms, updates, "updates")[0]
    given = dict(params=params, like=like, reduction=reduction, extra_args=extra_args)
    done = _ending.end(
      self.config, self._opt, added, ends, sums=sums, loss=window_loss, **given
    )
    return done.target, done.state

  def has_updated(self, state: MultiStepsState) -> jax.Array:
    """Whether the call that produced ``state`` applied an optimizer update.

    Unlike ``optax.MultiSteps.has_updated``, which infers it from the counters,
    this is ``False`` after a skipped micro-batch that follows an update.
    """
    return state.updated

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This accumulator as an ``optax.GradientTransformationExtraArgs``."""
    return optax.GradientTransformationExtraArgs(init=self.init, update=self.update)

"""Token-weighted gradient accumulation: a drop-in for ``optax.MultiSteps``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike, DTypeLike

from optax_accum import _checks
from optax_accum._collectives import (
  AxisName,
  ReplicaSum,
  on_any_shard,
  replica_index,
  replica_max,
  varying_over,
)

GradReduction = Literal["mean", "sum", "window_mean"]
NonFinitePolicy = Literal["skip_window", "skip_micro_batch"]
EveryKSchedule = int | Callable[[jax.Array], ArrayLike]
ShouldSkipUpdateFn = Callable[..., tuple[ArrayLike, Any]]

#: Extra argument the inner optimizer receives at the end of a window: the
#: window's total weight (items behind the emitted gradient).
WINDOW_WEIGHT = "window_weight"
#: Extra argument the inner optimizer receives at the end of a window: how many
#: micro-batches the window accumulated.
WINDOW_MICRO_STEPS = "window_micro_steps"


class MultiStepsState(NamedTuple):
  """State of :class:`MultiSteps`.

  The first fields have the names and meaning of ``optax.MultiStepsState``.

  Attributes:
    mini_step: int32 ``[]``. Micro-batches accumulated in the current window.
    gradient_step: int32 ``[]``. Optimizer updates applied so far; a window
      whose total weight is 0 ends without an update and is not counted.
    inner_opt_state: State of the wrapped optimizer. Touched only by updates.
    acc_grads: Like params, in the accumulator dtype. The window's running sum
      of ``weight * grad`` (``grad_reduction="mean"``) or of ``grad``
      (``"sum"``). While ``mini_step`` is 0 it counts as zeros, whatever it
      holds: ``make_train_step`` leaves the last window's sum there. Under
      plain ``jit`` with ``axis_name``, ``make_train_step`` keeps each
      replica's partial sum instead, with a leading axis of replicas (it
      accepts either layout, and a checkpoint of either resumes exactly).
    acc_weight: float ``[]``, the accumulator's widest dtype. The window's
      running sum of weights.
    acc_loss: Like ``acc_weight``. The window's running sum of
      ``weight * loss`` (``"mean"``) or ``loss`` (``"sum"``) for calls that pass
      ``loss=``; divided by ``acc_weight`` it is the window's token-mean loss.
    updated: bool ``[]``. Whether the last call applied an update.
    skipped_micro_batches: int32 ``[]``, saturating. Micro-batches dropped on
      their own: a negative or non-finite ``weight``, or (with
      ``on_nonfinite="skip_micro_batch"``) a non-finite gradient or loss.
    skipped_windows: int32 ``[]``, saturating. Windows that ended with positive
      weight but a non-finite gradient or loss, and so without an update.
    skip_state: Whatever ``should_skip_update_fn`` returned last; ``()``
      without one.
    micro_batches_seen: int32 ``[]``, saturating. Every micro-batch :meth:`add`
      has seen in the run, whatever became of it (rejected, dropped, of weight
      0, in a skipped window). ``make_train_step`` gives the run's ``n``-th
      micro-batch the key ``jax.random.fold_in(rng, n)`` with this count, so
      no two micro-batches of a run share a key (for the first ``2**31 - 1``).
      A state built by hand without it starts at 0.
    last_window_loss: Like ``acc_weight``. The loss of the window that ended
      last (:meth:`MultiSteps.window_loss` at its end), whether or not it
      applied an update: readable after the update, when ``acc_loss`` is
      already reset. 0 before the first window ends, or without ``loss=``.
    last_window_weight: Like ``acc_weight``. That window's total weight.
      A state built by hand (or restored) without these two starts at 0.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: optax.OptState
  acc_grads: optax.Updates
  acc_weight: jax.Array
  acc_loss: jax.Array
  updated: jax.Array
  skipped_micro_batches: jax.Array
  skipped_windows: jax.Array
  skip_state: Any = ()
  micro_batches_seen: ArrayLike = np.int32(0)
  last_window_loss: ArrayLike = np.float32(0)
  last_window_weight: ArrayLike = np.float32(0)


def _validated_every_k(
  every_k_schedule: EveryKSchedule,
) -> Callable[[jax.Array], ArrayLike]:
  if callable(every_k_schedule):
    return every_k_schedule
  if isinstance(every_k_schedule, bool) or not isinstance(
    every_k_schedule, int | np.integer
  ):
    raise ValueError(
      "`every_k_schedule` must be an int or a callable of the update count, "
      f"got {every_k_schedule!r} ({type(every_k_schedule).__name__})."
    )
  if every_k_schedule < 1:
    raise ValueError(f"`every_k_schedule` must be >= 1, got {every_k_schedule}.")
  k = int(every_k_schedule)
  return lambda step: k


def _all_finite(*trees: Any) -> jax.Array:
  """Whether every element of every leaf is finite (a bool scalar)."""
  finite = jnp.array(True)
  for leaf in jax.tree.leaves(trees):
    finite = finite & jnp.all(jnp.isfinite(leaf))
  return finite


def _wider(a: Any, b: Any) -> Any:
  """The wider of two float dtypes (no promotion rules involved)."""
  return a if jnp.dtype(a).itemsize >= jnp.dtype(b).itemsize else b


def _count_if(flag: jax.Array, counter: jax.Array) -> jax.Array:
  return jnp.where(flag, optax.safe_increment(counter), counter)


def _kept_unless(ends: jax.Array, new: jax.Array, old: ArrayLike) -> jax.Array:
  """``new`` if ``ends`` else ``old`` (cast to ``new``'s dtype)."""
  return jnp.where(ends, new, jnp.asarray(old).astype(new.dtype))


def _varying_like(x: ArrayLike, aval: Any) -> jax.Array:
  """``x``, marked as varying over the manual mesh axes ``aval`` varies over."""
  return varying_over(x, aval.manual_axis_type.varying)


def _once_if(pred: jax.Array, fn: Callable[[Any], Any], init: Any) -> Any:
  """``fn(init)`` if ``pred`` else ``init``, as a loop that runs once or never.

  Examples:
    >>> float(_once_if(jnp.array(True), lambda x: x + 1, jnp.array(1.0)))
    2.0
    >>> float(_once_if(jnp.array(False), lambda x: x + 1, jnp.array(1.0)))
    1.0
  """
  return jax.lax.while_loop(
    lambda carry: carry[0],
    lambda carry: (jnp.zeros_like(carry[0]), fn(carry[1])),
    (pred, init),
  )[1]


class MultiSteps:
  r"""Accumulates gradients over a window of micro-batches, weighted by items.

  A drop-in for :class:`optax.MultiSteps` that gives exactly the whole-batch
  gradient when micro-batches hold different numbers of items (tokens,
  samples). Each call passes one micro-batch's gradient :math:`g_i` and its
  ``weight`` :math:`w_i`; when the window ends the inner optimizer receives

  .. math::
    g = \frac{\sum_i w_i\, g_i}{\sum_i w_i}

  (with ``grad_reduction="mean"``: :math:`g_i` is the gradient of the mean
  loss over the micro-batch's :math:`w_i` items), i.e. the gradient of the
  token mean over the whole window. With ``grad_reduction="sum"``, :math:`g_i`
  is the gradient of the summed loss and the numerator is :math:`\sum_i g_i`.
  Without ``weight`` every micro-batch weighs 1, which is what
  ``optax.MultiSteps`` computes.

  A window ends after ``every_k_schedule(gradient_step)`` counted micro-batches
  or on a call with ``end_window=True``. The inner optimizer runs on that call
  only, and receives the window's total weight and micro-batch count as the
  extra arguments ``window_weight`` and ``window_micro_steps`` (an inner
  optimizer that rejects unknown extra arguments, such as ``optax.lbfgs``, runs
  without them). Every other call returns exact zeros and leaves the inner state
  untouched. A window whose total weight is 0 ends without an update and is
  not counted in ``gradient_step``.

  What each micro-batch does to the window:

  =====================================  ================  ========
  micro-batch                            counts towards k  adds
  =====================================  ================  ========
  ``weight > 0``, finite gradient        yes               its grad
  ``weight == 0`` (all padding)          yes               nothing
  ``weight`` negative or not finite      yes, as skipped   nothing
  non-finite grad, ``skip_micro_batch``  yes, as skipped   nothing
  non-finite grad, ``skip_window``       yes               its grad
  rejected by ``should_skip_update_fn``  no (as in optax)  nothing
  =====================================  ================  ========

  With ``axis_name``, a micro-batch is the same on every replica: a rejection,
  a bad weight or (``skip_micro_batch``) a non-finite gradient on one replica
  drops it on all of them, counted once.

  Weights, their sum and the products ``weight * grad`` are float32 at least,
  whatever ``accumulator_dtype`` is; only the running sum is stored in it.
  A window whose gradient (the sum times ``1 / total weight``, cast to each
  leaf's dtype: what the inner optimizer would receive) or loss is not finite
  ends without an update whatever the policy, whether a micro-batch brought a
  NaN or the sum or the cast to a float16 leaf overflowed: params, the inner
  state, ``gradient_step`` and any schedule are untouched, and
  ``skipped_windows`` counts it. "Adds nothing" and the reset at the end of a
  window are selections, not products with 0, so a NaN in one window never
  reaches the next. (After a window that ``make_train_step`` ended,
  ``acc_grads`` keeps that window's sum, NaN included, until the next window's
  first micro-batch overwrites it.)

  Args:
    opt: The optimizer to run once per window.
    every_k_schedule: Micro-batches per window: an int ``>= 1``, or a callable
      of the update count (int32 ``[]``) returning one (cast to int32). A
      value below 1 returned at run time is treated as 1.
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
      count, known before the window starts (Hugging Face's
      ``num_items_in_batch``), so the micro-batches' losses and gradients add
      up to the window's mean: they are summed as they are, and ``weight``
      (optional, default 1) only counts items for the state, the metrics and
      ``window_weight``. :meth:`window_loss` is then the sum of the losses.
    axis_name: Inside ``shard_map`` or ``pmap``: the data-parallel mesh axis
      (or axes) to sum weights, weighted gradients and losses over, so each
      window's gradient is the token mean over all replicas. Not needed under
      ``jit`` with sharded arrays, where gradients are already global.
    on_nonfinite: What a non-finite (NaN or infinite) gradient or loss in a
      micro-batch with positive weight does: ``"skip_window"`` (default) drops
      its whole window atomically when the window ends; ``"skip_micro_batch"``
      drops only that micro-batch (one more check per micro-batch) and keeps
      the window. Either way the state counts what was dropped.

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

  References:
    Unsloth, `Bug fixes in gradient accumulation
    <https://unsloth.ai/blog/gradient>`_, 2024.
  """

  def __init__(
    self,
    opt: optax.GradientTransformation,
    every_k_schedule: EveryKSchedule,
    use_grad_mean: bool = True,
    should_skip_update_fn: ShouldSkipUpdateFn | None = None,
    accumulator_dtype: DTypeLike | None = None,
    *,
    grad_reduction: GradReduction = "mean",
    axis_name: AxisName | None = None,
    on_nonfinite: NonFinitePolicy = "skip_window",
  ):
    if not (hasattr(opt, "init") and hasattr(opt, "update")):
      raise ValueError(
        f"`opt` must be an optax.GradientTransformation, got {type(opt).__name__}."
      )
    if grad_reduction not in ("mean", "sum", "window_mean"):
      raise ValueError(
        "`grad_reduction` must be 'mean', 'sum' or 'window_mean', got "
        f"{grad_reduction!r}."
      )
    if on_nonfinite not in ("skip_window", "skip_micro_batch"):
      raise ValueError(
        "`on_nonfinite` must be 'skip_window' or 'skip_micro_batch', got "
        f"{on_nonfinite!r}."
      )
    if not isinstance(use_grad_mean, bool | np.bool_):
      raise ValueError(f"`use_grad_mean` must be a bool, got {use_grad_mean!r}.")
    if accumulator_dtype is not None and not jnp.issubdtype(
      accumulator_dtype, jnp.inexact
    ):
      raise ValueError(
        "`accumulator_dtype` must be a floating-point dtype, got "
        f"{jnp.dtype(accumulator_dtype)}."
      )
    self._arguments = dict(
      opt=opt,
      every_k_schedule=every_k_schedule,
      use_grad_mean=use_grad_mean,
      should_skip_update_fn=should_skip_update_fn,
      accumulator_dtype=accumulator_dtype,
      grad_reduction=grad_reduction,
      axis_name=axis_name,
      on_nonfinite=on_nonfinite,
    )
    self._opt = optax.with_extra_args_support(opt)
    self._every_k_schedule = _validated_every_k(every_k_schedule)
    self._constant_k = None if callable(every_k_schedule) else int(every_k_schedule)
    # A window_mean window's sum is its mean already.
    self._use_grad_mean = bool(use_grad_mean) and grad_reduction != "window_mean"
    self._should_skip_update_fn = should_skip_update_fn
    self._accumulator_dtype = (
      None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)
    )
    self._grad_reduction = grad_reduction
    self._axis_name = axis_name
    self._on_nonfinite = on_nonfinite

  def replace(self, **changes: Any) -> MultiSteps:
    """A copy with some constructor arguments changed (``opt=`` included).

    Examples:
      >>> import optax, optax_accum
      >>> acc = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
      >>> acc.replace(opt=optax.adam(1e-3)).k_at(0)
      Array(4, dtype=int32)
    """
    args = {**self._arguments, **changes}
    return MultiSteps(args.pop("opt"), **args)

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer (with extra-args support)."""
    return self._opt

  def with_axis_name(self, axis_name: AxisName) -> MultiSteps:
    """A copy of this accumulator that sums over mesh axis ``axis_name``."""
    copy = object.__new__(MultiSteps)
    copy.__dict__.update(self.__dict__, _axis_name=axis_name)
    return copy

  @property
  def axis_name(self) -> AxisName | None:
    """The mesh axis (or axes) weights and gradients are summed over, if any."""
    return self._axis_name

  @property
  def on_nonfinite(self) -> NonFinitePolicy:
    """What a non-finite gradient drops: its micro-batch or its whole window."""
    return self._on_nonfinite

  @property
  def constant_k(self) -> int | None:
    """The window length when ``every_k_schedule`` is an int, else ``None``."""
    return self._constant_k

  @property
  def counts_every_micro_batch(self) -> bool:
    """Whether every micro-batch counts towards ``k`` (no
    ``should_skip_update_fn`` that could reject one)."""
    return self._should_skip_update_fn is None

  @property
  def grad_reduction(self) -> GradReduction:
    """How the caller reduces each micro-batch's loss: ``"mean"``, ``"sum"``
    or ``"window_mean"``."""
    return self._grad_reduction

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
    if self._grad_reduction == "window_mean":
      return jnp.asarray(state.acc_loss)
    positive = state.acc_weight > 0
    weight = jnp.where(positive, state.acc_weight, jnp.ones_like(state.acc_weight))
    return jnp.where(positive, state.acc_loss / weight, jnp.zeros_like(weight))

  def _acc_dtype(self, dtype: Any) -> Any:
    if self._accumulator_dtype is not None:
      return self._accumulator_dtype
    floor = jnp.dtype(
      jnp.complex64 if jnp.issubdtype(dtype, jnp.complexfloating) else jnp.float32
    )
    return dtype if jnp.dtype(dtype).itemsize > floor.itemsize else floor

  def init(self, params: optax.Params) -> MultiStepsState:
    """Returns the state for a fresh run: an empty window and no updates."""
    _checks.check_inexact_leaves(params, name="params")
    # zeros_like keeps each leaf's sharding, so the accumulator is sharded like
    # the params it accumulates for.
    acc_grads = jax.tree.map(
      lambda p: jnp.zeros_like(p, dtype=self._acc_dtype(jnp.result_type(p))), params
    )
    acc_dtypes = [jnp.dtype(a.dtype) for a in jax.tree.leaves(acc_grads)]
    weight_dtype = max(
      [jnp.dtype(jnp.float32)]
      + [d for d in acc_dtypes if jnp.issubdtype(d, jnp.floating)],
      key=lambda d: d.itemsize,
    )
    gradient_step = jnp.zeros([], jnp.int32)
    skip_state: Any = ()
    if self._should_skip_update_fn is not None:
      zeros = jax.tree.map(jnp.zeros_like, params)
      _, skip_state = self._should_skip_update_fn(zeros, gradient_step, params)
    return MultiStepsState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=gradient_step,
      inner_opt_state=self._opt.init(params),
      acc_grads=acc_grads,
      acc_weight=jnp.zeros([], weight_dtype),
      acc_loss=jnp.zeros([], weight_dtype),
      updated=jnp.zeros([], jnp.bool_),
      skipped_micro_batches=jnp.zeros([], jnp.int32),
      skipped_windows=jnp.zeros([], jnp.int32),
      skip_state=skip_state,
      micro_batches_seen=jnp.zeros([], jnp.int32),
      last_window_loss=jnp.zeros([], weight_dtype),
      last_window_weight=jnp.zeros([], weight_dtype),
    )

  def update(
    self,
    updates: optax.Updates,
    state: MultiStepsState,
    params: optax.Params | None = None,
    *,
    weight: ArrayLike | None = None,
    end_window: ArrayLike | None = None,
    loss: ArrayLike | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, MultiStepsState]:
    """Adds one micro-batch to the window; runs the optimizer if it ends it.

    Args:
      updates: The micro-batch's gradient, a tree like params.
      state: The current state.
      params: Current params, forwarded to the inner optimizer.
      weight: Items (tokens, samples) behind ``updates``; a scalar, traced or
        not. Defaults to 1. Required with ``grad_reduction="sum"``.
      end_window: Optional bool scalar, traced or not: end the window with this
        micro-batch even if it holds fewer than ``k`` micro-batches.
      loss: Optional loss of the micro-batch, reduced like its gradient; the
        state's ``acc_loss`` then sums it into the window's loss, the inner
        optimizer gets that loss (:meth:`window_loss`) as the extra argument
        ``value`` (what ``optax.contrib.reduce_on_plateau`` reads) unless it
        refuses it, and ``last_window_loss`` keeps it after the window ends.
      **extra_args: Forwarded to the inner optimizer's update.

    Returns:
      The inner optimizer's updates on the call that ends a window with
      positive weight, exact zeros on every other call; and the new state.
    """
    if loss is not None and "value" in extra_args:
      raise ValueError(
        "Pass `loss=` or `value=`, not both: with `loss=` the inner optimizer "
        "(optax.contrib.reduce_on_plateau) gets the window's loss as `value`."
      )
    added, counted = self.add(updates, state, params, weight=weight, loss=loss)
    optional_args = None if loss is None else {"value": self.window_loss(added)}
    ends = self.window_ends(added, counted, end_window)
    new_updates, new_state, _ = self.close(
      added, ends, params, grads_like=updates, optional_args=optional_args, **extra_args
    )
    return new_updates, new_state

  def add(
    self,
    updates: optax.Updates,
    state: MultiStepsState,
    params: optax.Params | None = None,
    *,
    weight: ArrayLike | None = None,
    loss: ArrayLike | None = None,
    reduce_gradient: bool = True,
  ) -> tuple[MultiStepsState, jax.Array]:
    """First half of :meth:`update`: adds a micro-batch, never ends the window.

    Building block for train steps that know the window cannot end on this
    micro-batch (the accumulate-only program of ``make_train_step``), or that
    end it themselves with :meth:`close` (scan mode).

    With ``axis_name`` and ``reduce_gradient=False``, the weighted gradient is
    added to this replica's own partial sum instead of being summed over the
    replicas now: ``acc_grads`` then differs per replica (the weight, loss and
    counters do not), and the caller sums it once with :meth:`replica_sum`
    before :meth:`close`: one gradient reduction per window instead of one
    per micro-batch. A gradient JAX already summed over the replicas is added
    on the first replica only.

    Returns:
      The state with the micro-batch added (``updated`` False), and whether
      the micro-batch counts towards ``k`` (not rejected by
      ``should_skip_update_fn``).
    """
    _checks.check_tree_matches(
      updates,
      state.acc_grads,
      name="updates",
      ref_name="the accumulator (from init(params))",
    )
    weight_dtype = state.acc_weight.dtype
    if weight is None:
      if self._grad_reduction == "sum":
        raise ValueError(
          "`weight` is required with grad_reduction='sum': the number of "
          "items behind each summed-loss gradient normalises the window."
        )
      weight = 1
    w = _checks.scalar(weight, name="weight", dtype=weight_dtype)

    summed = None if self._axis_name is None else ReplicaSum(self._axis_name)
    if summed is not None and summed.tracked:
      # `weight` is each replica's own, whatever its type says: a constant (or
      # the default 1) is the same on every replica but still sums over them,
      # as it does under pmap or check_vma=False.
      w = varying_over(w, summed.axes)
    skip_state = state.skip_state
    counted = jnp.array(True)
    if self._should_skip_update_fn is not None:
      skip, skip_state = self._should_skip_update_fn(
        updates, state.gradient_step, params
      )
      if (jnp.result_type(skip), jnp.shape(skip)) != (jnp.bool_, ()):
        raise ValueError(
          "`should_skip_update_fn` must return a bool scalar, got dtype "
          f"{jnp.result_type(skip)} and shape {jnp.shape(skip)}."
        )
      if summed is not None:
        # A rejection on any replica rejects the micro-batch on all of them, so
        # every replica keeps the same window, and the same `skip_state`: its
        # leaves' maximum over the replicas.
        skip = summed(jnp.asarray(skip).astype(jnp.int32)) > 0
        skip_state = replica_max(skip_state, summed)
      counted = jnp.logical_not(skip)

    # Negative or non-finite weights count towards k but add nothing. The
    # `where` (not a product with 0) keeps a NaN gradient out of the sum. A bad
    # weight on any replica drops the micro-batch on all of them (and on every
    # model shard), like a rejection, and is counted once.
    window = (w, state.acc_weight)
    dropped = on_any_shard(
      counted & ~(jnp.isfinite(w) & (w >= 0)), self._axis_name, window=window
    )
    adds = counted & ~dropped & (w > 0)
    if self._on_nonfinite == "skip_micro_batch":
      bad = adds & ~_all_finite(updates, () if loss is None else loss)
      bad = on_any_shard(bad, self._axis_name, window=window)
      adds, dropped = adds & ~bad, dropped | (counted & bad)
    w = jnp.where(adds, w, jnp.zeros_like(w))
    total_w = w if summed is None else summed(w)  # Over all replicas.

    def contribution(
      x: ArrayLike, dtype: Any, name: str, reduce: bool = True
    ) -> jax.Array:
      # Weights and their products stay at least as wide as the weight (float32)
      # whatever the accumulator dtype: a float16 accumulator must not turn a
      # weight of 70000 into inf, nor a bfloat16 one 257 into 256.
      dtype = _wider(dtype, weight_dtype)
      x = jnp.asarray(x).astype(dtype)
      if summed is None:
        local_axes: tuple[str, ...] = ()
        keep = adds
      else:
        local_axes = summed.local_axes(x)
        missing = set(summed.local_axes(w)) - set(local_axes)
        if missing and self._grad_reduction == "mean":
          raise ValueError(
            f"{name} is already summed over mesh axis {sorted(missing)[0]!r} "
            "(JAX's autodiff sums the gradient of params that enter shard_map "
            "replicated), so the per-replica weights cannot be applied. Use "
            "grad_reduction='sum' with a summed loss, or make the params "
            "per-replica first: jax.lax.pcast(params, axis, to='varying') "
            "(make_train_step does this)."
          )
        # A value already summed over the replicas is masked by the total.
        keep = adds if local_axes else counted & (total_w > 0)
      if self._grad_reduction == "mean":
        # A per-replica mean weighs by its replica's items; an already-global
        # one (weight invariant too) by the total.
        x = x * (w if summed is None or local_axes else total_w).astype(dtype)
      x = jnp.where(keep, x, jnp.zeros_like(x))
      if summed is None:
        return x
      if not reduce:
        # This replica's share of the sum `replica_sum` takes later: a value
        # already summed over some axes counts on their first replica only.
        summed_axes = tuple(a for a in summed.axes if a not in local_axes)
        if summed_axes:
          first = replica_index(summed_axes) == 0
          x = jnp.where(first, x, jnp.zeros_like(x))
        return varying_over(x, summed.axes) if summed.tracked else x
      return jax.lax.psum(x, local_axes) if local_axes else x

    acc_loss = state.acc_loss
    if loss is not None:
      loss = _checks.scalar(loss, name="loss", dtype=weight_dtype)
      acc_loss = acc_loss + contribution(loss, acc_loss.dtype, "`loss`")
    # A window's first micro-batch overwrites whatever the accumulator holds
    # (see `close(empty_accumulator=False)`): a select fused into the add.
    first = state.mini_step == 0

    def accumulate(path: Any, acc: jax.Array, g: Any) -> jax.Array:
      name = f"`updates` leaf {jax.tree_util.keystr(path)}"
      term = contribution(g, acc.dtype, name, reduce_gradient)
      # Added in the product's dtype: one rounding to the accumulator's.
      start = jnp.where(first, jnp.zeros_like(acc), acc).astype(term.dtype)
      return (start + term).astype(acc.dtype)

    acc_grads = jax.tree_util.tree_map_with_path(accumulate, state.acc_grads, updates)
    added = state._replace(
      mini_step=jnp.where(
        counted, optax.safe_increment(state.mini_step), state.mini_step
      ),
      acc_grads=acc_grads,
      acc_weight=state.acc_weight + total_w,
      acc_loss=acc_loss,
      updated=jnp.zeros_like(state.updated),
      skipped_micro_batches=_count_if(dropped, state.skipped_micro_batches),
      skip_state=skip_state,
      micro_batches_seen=optax.safe_increment(
        jnp.asarray(state.micro_batches_seen, jnp.int32)
      ),
    )
    return added, counted

  def replica_sum(self, acc_grads: optax.Updates) -> optax.Updates:
    """The replicas' partial sums from ``add(..., reduce_gradient=False)``,
    summed over ``axis_name``: one reduction for the window."""
    if self._axis_name is None:
      return acc_grads
    summed = ReplicaSum(self._axis_name)
    return jax.tree.map(summed, acc_grads)

  def k_at(self, gradient_step: ArrayLike) -> jax.Array:
    """Micro-batches per window after ``gradient_step`` updates (int32, >= 1)."""
    k = jnp.asarray(self._every_k_schedule(jnp.asarray(gradient_step)))
    return jnp.maximum(k.astype(jnp.int32), 1)

  def window_ends(
    self,
    added: MultiStepsState,
    counted: ArrayLike,
    end_window: ArrayLike | None = None,
  ) -> jax.Array:
    """Whether the micro-batch just added (see :meth:`add`) ends the window."""
    ends = jnp.asarray(counted) & (added.mini_step >= self.k_at(added.gradient_step))
    if end_window is not None:
      ends = ends | _checks.scalar(end_window, name="end_window", dtype=jnp.bool_)
    return ends

  def close(
    self,
    added: MultiStepsState,
    ends: ArrayLike,
    params: optax.Params | None = None,
    *,
    grads_like: optax.Updates | None = None,
    optional_args: dict[str, Any] | None = None,
    apply_to: optax.Params | None = None,
    branchless: bool = False,
    empty_accumulator: bool = True,
    **extra_args: Any,
  ) -> tuple[optax.Updates, MultiStepsState, jax.Array]:
    """Second half of :meth:`update`: ends the window if ``ends`` is true.

    Args:
      added: A state returned by :meth:`add`.
      ends: Bool scalar: end the window now.
      params: Forwarded to the inner optimizer.
      grads_like: Tree whose leaf dtypes the window gradient is cast to before
        the inner optimizer sees it; defaults to ``params``.
      optional_args: Extra arguments the inner optimizer gets unless it
        refuses them, like the window totals (``make_train_step`` passes the
        window's loss as ``value``).
      apply_to: Optional params: return them updated (unchanged when no
        update applies) instead of the updates. Applying inside the
        conditional saves materialising a tree of zeros and adding it.
      branchless: Run the inner optimizer in a ``while_loop`` that runs once
        if the window ends with positive weight and a finite sum, and never
        otherwise, instead of a ``lax.cond``. XLA updates the loop's carry
        (params, optimizer state) in place, where a ``cond`` or a select
        between new and old values copies them first; on CPU it is also much
        faster than a ``cond``. For callers that call ``close`` when the
        window is about to end. Not reverse-mode differentiable (a
        ``while_loop``).
      empty_accumulator: Zero ``acc_grads`` when the window ends (default).
        ``False`` leaves the window's sum there, for the next :meth:`add` to
        overwrite (a window's first micro-batch ignores what the accumulator
        holds): zeroing it in a program that also reads it makes XLA copy it.
      **extra_args: Forwarded to the inner optimizer.

    Returns:
      ``(updates, state, grad_norm)``: the inner optimizer's updates (exact
      zeros unless the window ends with positive weight), the new state, and
      the global norm of the window gradient that was applied (0 if none;
      float32, its squares summed in the weight's dtype: inf when they
      overflow, from elements above ~1e19 in float32, while the update still
      applies).
    """
    for name in (WINDOW_WEIGHT, WINDOW_MICRO_STEPS):
      if name in extra_args:
        raise ValueError(
          f"`{name}` is reserved: MultiSteps passes the window's totals to the "
          "inner optimizer itself."
        )
    if grads_like is None:
      grads_like = params if params is not None else added.acc_grads
    ends = jnp.asarray(ends)
    acc_weight = added.acc_weight
    positive = ends & (acc_weight > 0)
    scale = acc_weight if self._use_grad_mean else jnp.ones_like(acc_weight)
    inverse = 1 / scale  # In the weight's dtype: float32 at least.

    def window_grad(acc: jax.Array, like: Any) -> jax.Array:
      # A product with the reciprocal (within 1 ulp of the quotient): XLA
      # fuses it into the optimizer's ops, where a quotient gets a buffer.
      dtype = _wider(acc.dtype, inverse.dtype)
      product = acc.astype(dtype) * inverse.astype(dtype)
      return product.astype(jnp.result_type(like))

    def window_squares() -> jax.Array:
      # The squared norm of the gradient the inner optimizer would receive,
      # each element in its leaf's dtype, summed in the weight's dtype, plus
      # `g - g`: NaN exactly when an element is not finite (inf - inf is NaN),
      # whether the sum, the product or the cast to a float16 leaf overflowed;
      # inf when only the squares overflow. One pass serves the finite check
      # and the norm; XLA does not simplify `x - x` to 0. (`x * 0` does the
      # same, but XLA:CPU then writes a leaf-shaped array of zeros and every
      # leaf's reduction reads it: 38 MB more per update, 4.2 MB more scratch,
      # on an MLP of eight 1024 x 1024 leaves.)
      squares = [
        jnp.sum(jnp.square(g) + (g - g))
        for g in jax.tree.leaves(
          jax.tree.map(
            lambda acc, like: jnp.abs(window_grad(acc, like)).astype(acc_weight.dtype),
            added.acc_grads,
            grads_like,
          )
        )
      ]
      return sum(squares, jnp.zeros([], acc_weight.dtype))

    def nonfinite_window(squares: jax.Array | None = None) -> jax.Array:
      # A NaN or Inf anywhere in the window, on any model shard, skips it.
      squares = window_squares() if squares is None else squares
      flag = jnp.isnan(squares) | ~_all_finite(added.acc_loss, acc_weight)
      return on_any_shard(flag, self._axis_name, window=acc_weight)

    squares: jax.Array | None = None
    if branchless:  # One pass serves the check and the metric.
      squares = window_squares()
      nonfinite = positive & nonfinite_window(squares)
    else:  # Only the call that ends a window reads its whole accumulator.
      aval = jax.make_jaxpr(nonfinite_window)().out_avals[0]
      nonfinite = jax.lax.cond(
        positive, nonfinite_window, lambda: _varying_like(jnp.array(False), aval)
      )
    applies = positive & ~nonfinite
    inner_state = added.inner_opt_state

    def apply_update(
      inner_state: optax.OptState = inner_state,
      apply_to: optax.Params | None = apply_to,
      params: optax.Params | None = params,
    ) -> tuple[optax.Updates, optax.OptState, jax.Array]:
      grads = jax.tree.map(window_grad, added.acc_grads, grads_like)
      optional = {
        WINDOW_WEIGHT: acc_weight,
        WINDOW_MICRO_STEPS: added.mini_step,
        **(optional_args or {}),
      }
      try:
        new_updates, inner = self._opt.update(
          grads, inner_state, params, **extra_args, **optional
        )
      except TypeError as e:
        if not any(name in str(e) for name in optional):
          raise
        # The inner optimizer rejects extra arguments it does not use (as
        # optax's line searches do): it runs without the optional ones.
        new_updates, inner = self._opt.update(grads, inner_state, params, **extra_args)
      # Keep the inner state's dtypes so both branches of the cond agree.
      inner = jax.tree.map(
        lambda new, old: jnp.asarray(new).astype(jnp.result_type(old)),
        inner,
        inner_state,
      )
      grad_norm = jnp.sqrt(window_squares() if squares is None else squares)
      if apply_to is not None:
        new_updates = optax.apply_updates(apply_to, new_updates)
      return new_updates, inner, grad_norm.astype(jnp.float32)

    def hold() -> tuple[optax.Updates, optax.OptState, jax.Array]:
      # Outputs typed like the update branch's, including, inside shard_map,
      # the mesh axes they vary over.
      jaxpr, shapes = jax.make_jaxpr(apply_update, return_shape=True)()
      avals = jax.tree.unflatten(jax.tree.structure(shapes), jaxpr.out_avals)
      if apply_to is None:
        unchanged = jax.tree.map(
          lambda a: _varying_like(jnp.zeros(a.shape, a.dtype), a), avals[0]
        )
      else:
        unchanged = jax.tree.map(_varying_like, apply_to, avals[0])
      norm = _varying_like(jnp.zeros(avals[2].shape, avals[2].dtype), avals[2])
      return unchanged, jax.tree.map(_varying_like, inner_state, avals[1]), norm

    def reset(x: jax.Array) -> jax.Array:
      return jnp.where(ends, jnp.zeros_like(x), x)

    if branchless:
      # The update runs in a loop that runs once or never: XLA updates a loop's
      # carry in place, where a select between the new and the old values (or
      # a cond) keeps both alive and copies params and optimizer state first.
      in_place = apply_to is not None and apply_to is params

      def update(carry: Any) -> Any:
        out, inner, _ = carry
        applied_to = None if apply_to is None else out
        return apply_update(inner, applied_to, out if in_place else params)

      new_updates, inner_opt_state, grad_norm = _once_if(applies, update, hold())
    else:
      new_updates, inner_opt_state, grad_norm = jax.lax.cond(
        applies, apply_update, hold
      )
    acc_grads = added.acc_grads
    if empty_accumulator:
      acc_grads = jax.tree.map(reset, acc_grads)

    new_state = added._replace(
      mini_step=reset(added.mini_step),
      gradient_step=jnp.where(
        applies, optax.safe_increment(added.gradient_step), added.gradient_step
      ),
      inner_opt_state=inner_opt_state,
      acc_grads=acc_grads,
      acc_weight=reset(acc_weight),
      acc_loss=reset(added.acc_loss),
      updated=applies,
      skipped_windows=_count_if(nonfinite, added.skipped_windows),
      last_window_loss=_kept_unless(
        ends, self.window_loss(added), added.last_window_loss
      ),
      last_window_weight=_kept_unless(ends, acc_weight, added.last_window_weight),
    )
    return new_updates, new_state, grad_norm

  def has_updated(self, state: MultiStepsState) -> jax.Array:
    """Whether the call that produced ``state`` applied an optimizer update.

    Unlike ``optax.MultiSteps.has_updated``, which infers it from the counters,
    this is ``False`` after a skipped micro-batch that follows an update.
    """
    return state.updated

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This accumulator as an ``optax.GradientTransformationExtraArgs``."""
    return optax.GradientTransformationExtraArgs(init=self.init, update=self.update)

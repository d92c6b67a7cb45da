"""``make_train_step``: a jitted accumulation step that always applies its update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from optax_accum import _checks
from optax_accum._collectives import (
  AxisName,
  ReplicaSum,
  replica_index,
  varying_over,
)
from optax_accum._inspect import find_states, get_hyperparams
from optax_accum._multi_steps import EveryKSchedule, MultiSteps, MultiStepsState
from optax_accum._replicas import (
  DataLayout,
  data_layout,
  has_partial_sums,
  per_replica,
  sharded_programs,
  summed,
)

Mode = Literal["stream", "scan"]
Metrics = dict[str, Any]
StepOutput = tuple[optax.Params, MultiStepsState, Metrics]


def _is_traced(*trees: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def _host_int(x: jax.Array) -> int:
  """A replicated scalar's value, read from this process's own copy."""
  if getattr(x, "is_fully_addressable", True):
    return int(jax.device_get(x))
  return int(np.asarray(x.addressable_shards[0].data))


def _per_replica(params: Any, summed: ReplicaSum) -> Any:
  """``params`` marked as differing per replica, so their gradients stay local.

  Inside ``shard_map`` JAX would otherwise sum the gradient of replicated
  params over the replicas before the per-replica token weights are applied.
  """
  if not summed.tracked:
    return params
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharded = set(summed.local_axes(p))
    if sharded:
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} differs per replica over mesh axis "
        f"{sorted(sharded)[0]!r}, the data axis `axis_name` sums over: params "
        "sharded over the data axis (FSDP, ZeRO) would have their gradients "
        "summed twice. Pass params replicated over it (in_specs P() or P over "
        "a model axis only), or shard them over the data axis under plain jit "
        "without axis_name, where XLA reduce-scatters each micro-batch's "
        "gradient."
      )
  return jax.tree.map(lambda p: varying_over(p, summed.axes), params)


def _local_zeros(axis_name: AxisName) -> Callable[[jax.Array], jax.Array]:
  """Zeros like an array, marked as this replica's own over ``axis_name``."""
  summed = ReplicaSum(axis_name)

  def zeros(x: jax.Array) -> jax.Array:
    zeros = jnp.zeros_like(x)
    return varying_over(zeros, summed.axes) if summed.tracked else zeros

  return zeros


def _unaliased(donated: Any, kept: Any) -> Any:
  """``donated`` with every array that is used twice replaced by a copy.

  A buffer cannot be donated twice in one call, nor donated and also read as
  a plain argument (``kept``); a hand-built optimizer state or batch can hold
  one array in two places.
  """
  seen = {id(x) for x in jax.tree.leaves(kept) if isinstance(x, jax.Array)}

  def fresh(x: Any) -> Any:
    if not isinstance(x, jax.Array):
      return x
    if id(x) in seen:
      return jnp.copy(x)
    seen.add(id(x))
    return x

  return jax.tree.map(fresh, donated)


def _counters(state: MultiStepsState) -> MultiStepsState:
  """``state`` without its params-sized parts: the counters and window totals.

  The programs take the params-sized parts (params, inner optimizer state,
  accumulator) as separate, donated arguments and these as plain ones: never
  donated, so the metrics a step returns can share them and stay readable
  after later steps.
  """
  return state._replace(inner_opt_state=None, acc_grads=None)


def _joined(counters: MultiStepsState, inner: Any, acc: Any) -> MultiStepsState:
  return counters._replace(inner_opt_state=inner, acc_grads=acc)


_UNKNOWN: Any = object()  # A learning rate not looked up yet.


class _Known(NamedTuple):
  """What the host knows about the optimizer state a step returned last.

  Valid only for a state whose counters are those very array objects: a state
  the user built, restored or kept from earlier is read from the device.
  """

  mini_step: jax.Array  # The returned state's counters, compared by identity.
  gradient_step: jax.Array
  value: int | None  # Its value; None where counting depends on the data.
  k: int | None  # The window's length; None where it must be read.
  params: Any  # Params the update program returned: fresh, unaliased buffers.
  learning_rate: Any  # The metric (unchanged until the next update), or _UNKNOWN.
  layout: DataLayout | None = None  # Per-replica partial sums, under jit.

  def describes(self, state: MultiStepsState) -> bool:
    return (
      state.mini_step is self.mini_step and state.gradient_step is self.gradient_step
    )


class TrainStep:
  """The callable that :func:`make_train_step` returns.

  ``step(params, opt_state, batch, rng=None, *, end_window=False)`` returns
  ``(params, opt_state, metrics)``. In streaming mode one call takes one
  micro-batch; in scan mode one call takes a whole window, with the
  micro-batches along the batch's leading axis.

  Streaming runs two programs. ``accumulate_program`` only adds a micro-batch:
  it reads params and returns only what it changes (the accumulator and the
  counters), so a micro-step that cannot end a window costs a gradient and an
  add. ``update_program`` adds and, if the window ends, updates; it runs the
  inner optimizer in a loop that runs once if the window really ends with
  positive, finite weight and gradient, and never otherwise: XLA updates
  params and optimizer state in place. It leaves the window's sum in the
  accumulator for the next window's first micro-batch to overwrite.

  Which program runs is decided from the optimizer state's own counters, never
  from a counter of the step's: the step remembers the counter values of the
  state it returned last (it knows them without reading the device whenever
  every micro-batch counts), and reads the device only for a state it did not
  return (the first call, a restored checkpoint, a state kept from earlier),
  on every call with ``should_skip_update_fn`` (counting depends on the data),
  and once per window with a callable ``every_k_schedule``. A loop can thus
  queue step after step without waiting for any of them. Traced inside the
  caller's own ``jit`` or ``scan``, where the counters cannot be read, the
  step runs ``update_program`` (correct on any micro-step; the optimizer still
  runs once per window).
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    optimizer: MultiSteps,
    mode: Mode,
    has_aux: bool,
    donate: bool,
  ):
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.mode = mode
    self.has_aux = has_aux
    self.donate = donate
    # Donated: params, inner optimizer state and accumulator (not the counters).
    self.update_program = jax.jit(
      self._scan if mode == "scan" else self._update,
      donate_argnums=(0, 1, 2) if donate else (),
    )
    # Donated: the accumulator only. Params are read, not returned.
    self.accumulate_program = jax.jit(
      self._accumulate, donate_argnums=(1,) if donate else ()
    )
    self._sharded_programs: dict[DataLayout, tuple[Any, Any]] = {}
    self._known: _Known | None = None

  def __call__(
    self,
    params: optax.Params,
    opt_state: MultiStepsState,
    batch: Any,
    rng: jax.Array | None = None,
    *,
    end_window: ArrayLike = False,
  ) -> StepOutput:
    if not isinstance(opt_state, MultiStepsState):
      raise ValueError(
        "`opt_state` must come from step.init(params) (or optimizer.init(params) "
        "of the optax_accum.MultiSteps given to make_train_step), got "
        f"{type(opt_state).__module__}.{type(opt_state).__qualname__}."
      )
    if self.mode == "scan":
      _checks.check_scalar(end_window, name="end_window", dtype=jnp.bool_)
      if _is_traced(end_window) or bool(end_window):
        raise ValueError(
          "`end_window` is for streaming: in scan mode every call ends a window."
        )
      opt_state, layout = self._arranged(params, opt_state, batch)
      return self._run_update(params, opt_state, batch, rng, layout=layout)
    if end_window is not False:  # Checked on every micro-step, not only the last.
      _checks.check_scalar(end_window, name="end_window", dtype=jnp.bool_)
    counters = (opt_state.mini_step, opt_state.gradient_step, end_window)
    if any(isinstance(x, jax.core.Tracer) for x in counters):
      opt_state, _ = self._arranged(params, opt_state, batch)
      return self._run_update(params, opt_state, batch, rng, end_window)

    known = self._known
    hit = known is not None and known.describes(opt_state)
    if known is None or not hit:
      opt_state, layout = self._arranged(params, opt_state, batch)
      known = _Known(
        opt_state.mini_step,
        opt_state.gradient_step,
        None,
        None,
        None,
        _UNKNOWN,
        layout,
      )
    layout = known.layout
    mini_step = _host_int(opt_state.mini_step) if known.value is None else known.value
    k = known.k
    if k is None:
      k = int(self.optimizer.k_at(_host_int(opt_state.gradient_step)))
    ends = bool(end_window) or mini_step + 1 >= k
    learning_rate = known.learning_rate
    if ends:
      fresh = params is known.params  # Returned by the update program.
      params, opt_state, metrics = self._run_update(
        params,
        opt_state,
        batch,
        rng,
        end_window,
        check_aliasing=not fresh,
        layout=layout,
      )
      learning_rate = metrics.get("learning_rate")
    else:
      if learning_rate is _UNKNOWN:
        learning_rate = _copied_learning_rate(opt_state)
      params, opt_state, metrics = self._run_accumulate(
        params,
        opt_state,
        batch,
        rng,
        learning_rate,
        check_aliasing=not hit,
        layout=layout,
      )
    if isinstance(opt_state.mini_step, jax.core.Tracer):
      return params, opt_state, metrics  # Called with traced params or batch.
    counts = self.optimizer.counts_every_micro_batch
    self._known = _Known(
      mini_step=opt_state.mini_step,
      gradient_step=opt_state.gradient_step,
      value=(0 if ends else mini_step + 1) if counts else None,
      k=None if ends and self.optimizer.constant_k is None else k,
      params=params if ends else known.params,
      learning_rate=learning_rate,
      layout=layout,
    )
    return params, opt_state, metrics

  def init(self, params: optax.Params) -> MultiStepsState:
    """The optimizer state to start a run from: ``self.optimizer.init(params)``.

    Raises ``ValueError`` where the optimizer accumulates twice (an
    ``optax.MultiSteps`` inside the one the step wraps a plain optimizer in).
    """
    state = self.optimizer.init(params)
    if find_states(state.inner_opt_state, (MultiStepsState, optax.MultiStepsState)):
      raise ValueError(
        "The optimizer already accumulates (a MultiSteps inside it): pass the "
        "accumulator itself, an optax_accum.MultiSteps, to make_train_step."
      )
    return state

  def lower(
    self,
    params: optax.Params,
    opt_state: MultiStepsState,
    batch: Any,
    rng: jax.Array | None = None,
    *,
    program: Literal["accumulate", "update"] = "update",
  ) -> jax.stages.Lowered:
    """Lowers one of the step's programs for these arguments, without running it.

    For XLA's analyses (``.compile().memory_analysis()``, ``cost_analysis()``,
    ``as_text()``). ``"update"`` is the program that can end a window (in
    scan mode, the whole window's program); ``"accumulate"`` the streaming
    program for micro-steps that cannot.
    """
    opt_state, layout = self._arranged(params, opt_state, batch)
    accumulate_program, update_program = self._programs(layout)
    split = (opt_state.inner_opt_state, opt_state.acc_grads, _counters(opt_state))
    if program == "accumulate" and self.mode == "stream":
      return accumulate_program.lower(params, *split[1:], batch, rng)
    if program != "update":
      raise ValueError(
        f"`program` must be 'update' or, in streaming mode, 'accumulate'; got "
        f"{program!r}."
      )
    if self.mode == "scan":
      return update_program.lower(params, *split, batch, rng)
    return update_program.lower(params, *split, batch, rng, False)

  # -- calling the programs ------------------------------------------------

  def _arranged(
    self, params: Any, opt_state: MultiStepsState, batch: Any
  ) -> tuple[MultiStepsState, DataLayout | None]:
    """``opt_state`` with its accumulator in the layout this call runs with.

    Under plain ``jit`` with ``axis_name`` (concrete arrays: not inside
    ``shard_map``), the accumulator holds per-replica partial sums; anywhere
    else one sum. Called for a state the step did not return last.
    """
    acc = opt_state.acc_grads
    if self.optimizer.axis_name is None or _is_traced(params, opt_state, batch):
      if has_partial_sums(acc, params):
        opt_state = opt_state._replace(acc_grads=summed(acc, params))
      return opt_state, None
    layout = data_layout(
      self.optimizer.axis_name, params, batch, scan=self.mode == "scan"
    )
    return opt_state._replace(acc_grads=per_replica(acc, params, layout)), layout

  def _programs(self, layout: DataLayout | None) -> tuple[Any, Any]:
    """The accumulate and update programs for one accumulator layout."""
    if layout is None:
      return self.accumulate_program, self.update_program
    if layout not in self._sharded_programs:
      self._sharded_programs[layout] = sharded_programs(
        layout,
        self._accumulate,
        self._scan if self.mode == "scan" else self._update,
        scan=self.mode == "scan",
        donate=self.donate,
        has_aux=self.has_aux,
      )
    return self._sharded_programs[layout]

  def _run_update(
    self,
    params: Any,
    opt_state: MultiStepsState,
    batch: Any,
    rng: Any,
    *end_window: Any,
    check_aliasing: bool = True,
    layout: DataLayout | None = None,
  ) -> StepOutput:
    if self.donate and check_aliasing and not _is_traced(params, opt_state):
      params, opt_state = _unaliased((params, opt_state), (batch, rng))
    params, inner, acc, counters, metrics = self._programs(layout)[1](
      params,
      opt_state.inner_opt_state,
      opt_state.acc_grads,
      _counters(opt_state),
      batch,
      rng,
      *end_window,
    )
    return params, _joined(counters, inner, acc), metrics

  def _run_accumulate(
    self,
    params: Any,
    opt_state: MultiStepsState,
    batch: Any,
    rng: Any,
    learning_rate: jax.Array | None,
    check_aliasing: bool = True,
    layout: DataLayout | None = None,
  ) -> StepOutput:
    acc = opt_state.acc_grads
    if self.donate and check_aliasing and not _is_traced(params, acc):
      acc = _unaliased(acc, (params, opt_state.inner_opt_state, batch, rng))
    acc, counters, loss, grad_norm, aux = self._programs(layout)[0](
      params, acc, _counters(opt_state), batch, rng
    )
    state = _joined(counters, opt_state.inner_opt_state, acc)
    # The counters are never donated: the metrics can share them.
    metrics = _metrics(state, state, loss, grad_norm, aux, learning_rate)
    if not self.has_aux:
      del metrics["aux"]
    return params, state, metrics

  # -- the pieces ----------------------------------------------------------

  def _add_micro_batch(
    self,
    params: Any,
    state: MultiStepsState,
    batch: Any,
    rng: Any,
    reduce_gradient: bool,
  ) -> tuple[MultiStepsState, jax.Array, Any, Any]:
    """One micro-batch's weighted gradient added to ``state``'s accumulator.

    Returns the new state, whether the micro-batch counted, its gradient and
    its aux. ``reduce_gradient=False`` adds this replica's gradient only.
    """
    grads, value, weight, aux = self._grads(params, batch, rng, state)
    added, counted = self.optimizer.add(
      grads, state, params, weight=weight, loss=value, reduce_gradient=reduce_gradient
    )
    return added, counted, grads, aux

  def _grads(
    self, params: Any, batch: Any, rng: Any, state: MultiStepsState
  ) -> tuple[Any, ...]:
    """Gradient, loss, weight and aux of one micro-batch."""
    args: tuple[Any, ...] = (batch,)
    if rng is not None:
      # The run's n-th micro-batch gets fold_in(rng, n), whatever became of the
      # micro-batches before it, the same in streaming and scan mode.
      key = jax.random.fold_in(rng, state.micro_batches_seen)
      if self.optimizer.axis_name is not None:
        # Each replica draws its own dropout masks for its own rows.
        key = jax.random.fold_in(key, replica_index(self.optimizer.axis_name))
      args = (batch, key)

    if self.optimizer.axis_name is not None:
      params = _per_replica(params, ReplicaSum(self.optimizer.axis_name))

    def loss(p: Any) -> tuple[jax.Array, tuple[Any, Any]]:
      out = self.loss_fn(p, *args)
      if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(self._contract(f"got {type(out).__name__}"))
      value, rest = out
      if self.has_aux:
        if not (isinstance(rest, tuple) and len(rest) == 2):
          raise ValueError(self._contract(f"got (loss, {type(rest).__name__})"))
        return value, rest
      if isinstance(rest, tuple | list | dict):
        raise ValueError(
          self._contract(f"got (loss, {type(rest).__name__}): set has_aux=True?")
        )
      return value, (rest, None)

    (value, (weight, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return grads, value, weight, aux

  def _contract(self, got: str) -> str:
    want = "(loss, (weight, aux))" if self.has_aux else "(loss, weight)"
    return f"`loss_fn` must return {want} with has_aux={self.has_aux}, {got}."

  def _in_graph_metrics(
    self, added: MultiStepsState, new_state: MultiStepsState, grad_norm: Any, aux: Any
  ) -> Metrics:
    grad_norm = jnp.asarray(grad_norm, jnp.float32)
    metrics = _metrics(
      added,
      new_state,
      self.optimizer.window_loss(added),
      grad_norm,
      aux,
      _learning_rate(new_state),
    )
    if not self.has_aux:
      del metrics["aux"]
    return metrics

  def _accumulate(
    self,
    params: Any,
    acc: Any,
    counters: MultiStepsState,
    batch: Any,
    rng: Any,
    partial: bool = False,
  ) -> tuple[Any, MultiStepsState, jax.Array, jax.Array, Any]:
    """Adds a micro-batch. ``partial``: ``acc`` is this replica's partial sum."""
    state = _joined(counters, None, acc)
    added, _, _, aux = self._add_micro_batch(params, state, batch, rng, not partial)
    loss, grad_norm = self.optimizer.window_loss(added), jnp.zeros([], jnp.float32)
    return added.acc_grads, _counters(added), loss, grad_norm, aux

  def _update(
    self,
    params: Any,
    inner: Any,
    acc: Any,
    counters: MultiStepsState,
    batch: Any,
    rng: Any,
    end_window: Any,
    *,
    partial: bool = False,
  ) -> tuple[Any, ...]:
    """Adds a micro-batch and ends the window if it is full or ``end_window``.
    ``partial``: ``acc`` is this replica's partial sum, and stays one."""
    opt_state = _joined(counters, inner, acc)
    added, counted, grads, aux = self._add_micro_batch(
      params, opt_state, batch, rng, not partial
    )
    ends = self.optimizer.window_ends(added, counted, end_window)
    if not partial:
      return self._close(added, ends, params, aux, grads_like=grads)
    window = added._replace(acc_grads=self.optimizer.replica_sum(added.acc_grads))
    out = self._close(window, ends, params, aux, grads_like=grads)
    # A window that goes on keeps its partial sums; after one that ended, the
    # next window's first micro-batch overwrites them.
    return (*out[:2], added.acc_grads, *out[3:])

  def _scan(
    self,
    params: Any,
    inner: Any,
    acc: Any,
    counters: MultiStepsState,
    batch: Any,
    rng: Any,
    *,
    partial: bool = False,
  ) -> tuple[Any, ...]:
    """A whole window. ``partial``: ``acc`` is this replica's partial sum."""
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes or 0 in sizes:
      raise ValueError(
        "In scan mode every `batch` leaf needs the same leading micro-batch axis "
        f"of size >= 1, got leading sizes {sorted(map(str, sizes))}."
      )

    # With `axis_name` each replica sums its own micro-batches inside the loop,
    # and the replicas' sums are added up once after it: one gradient
    # reduction per window. A streamed part of the window that `acc` already
    # holds summed joins after the reduction.
    axis_name = self.optimizer.axis_name
    local = axis_name is not None
    start = acc
    if axis_name is not None and not partial:
      start = jax.tree.map(_local_zeros(axis_name), acc)

    def body(state: MultiStepsState, micro_batch: Any) -> tuple[MultiStepsState, Any]:
      added, _, _, aux = self._add_micro_batch(
        params, state, micro_batch, rng, not local
      )
      return added, aux

    # The inner optimizer's state stays out of the loop carry: only the
    # accumulator changes inside the scan.
    added, auxs = jax.lax.scan(body, _joined(counters, None, start), batch)
    partial_sums = added.acc_grads
    if local:
      window = self.optimizer.replica_sum(partial_sums)
      if not partial:
        streamed = counters.mini_step > 0
        window = jax.tree.map(
          lambda total, acc: total + jnp.where(streamed, acc, jnp.zeros_like(acc)),
          window,
          acc,
        )
      added = added._replace(acc_grads=window)
    added = added._replace(inner_opt_state=inner)
    out = self._close(added, True, params, auxs)
    return (*out[:2], partial_sums, *out[3:]) if partial else out

  def _close(
    self,
    added: MultiStepsState,
    ends: Any,
    params: Any,
    aux: Any,
    grads_like: Any = None,
  ) -> tuple[Any, ...]:
    """Ends the window if ``ends``, updating params in place; split outputs."""
    params, new_state, grad_norm = self.optimizer.close(
      added,
      ends,
      params,
      grads_like=grads_like,
      # The window's loss as optax's `value` (optax.contrib.reduce_on_plateau).
      optional_args={"value": self.optimizer.window_loss(added)},
      apply_to=params,
      branchless=True,
      empty_accumulator=False,
    )
    metrics = self._in_graph_metrics(added, new_state, grad_norm, aux)
    return (
      params,
      new_state.inner_opt_state,
      new_state.acc_grads,
      _counters(new_state),
      metrics,
    )


def _learning_rate(state: MultiStepsState) -> Any:
  """The injected learning rate, a dict of them by group, or ``None``."""
  try:
    return get_hyperparams(state).get("learning_rate")
  except ValueError:  # No injected hyperparameters.
    return None


def _copied_learning_rate(state: MultiStepsState) -> Any:
  """The state's learning rate(s) in buffers of their own (the state's are
  donated)."""
  return jax.tree.map(jnp.copy, _learning_rate(state))


def _metrics(
  added: MultiStepsState,
  new_state: MultiStepsState,
  loss: Any,
  grad_norm: Any,
  aux: Any,
  learning_rate: Any,
) -> Metrics:
  """The step's metrics from the window so far (``added``) and the new state."""
  metrics: Metrics = {
    "loss": loss,
    "weight": added.acc_weight,
    "micro_steps": added.mini_step,
    "updated": new_state.updated,
    "update_count": new_state.gradient_step,
    "grad_norm": grad_norm,
    "skipped_micro_batches": new_state.skipped_micro_batches,
    "skipped_windows": new_state.skipped_windows,
  }
  if learning_rate is not None:
    metrics["learning_rate"] = learning_rate
  metrics["aux"] = aux
  return metrics


def _accumulator(
  optimizer: Any, mode: Mode, every_k_schedule: EveryKSchedule | None
) -> MultiSteps:
  """``optimizer`` as the :class:`MultiSteps` a train step runs."""
  if isinstance(optimizer, MultiSteps):
    if every_k_schedule is not None:
      raise ValueError(
        "`every_k_schedule` is for a plain optax optimizer: this "
        "optax_accum.MultiSteps has its own."
      )
    return optimizer
  if not isinstance(optimizer, optax.GradientTransformation):
    raise ValueError(
      "`optimizer` must be an optax_accum.MultiSteps or an optax "
      "GradientTransformation, got "
      f"{type(optimizer).__module__.partition('.')[0]}."
      f"{type(optimizer).__qualname__}: wrap your optimizer `opt` as optax_accum."
      "MultiSteps(opt, every_k_schedule=k) (it takes optax.MultiSteps' "
      "arguments, so it replaces one as it is)."
    )
  if mode == "scan":
    if every_k_schedule is not None:
      raise ValueError(
        "`every_k_schedule` has no effect in scan mode: the batch's leading "
        "micro-batch axis is the window."
      )
    every_k_schedule = 1  # Never read: every scan-mode call ends its window.
  elif every_k_schedule is None:
    raise ValueError(
      "`optimizer` must be an optax_accum.MultiSteps in streaming mode unless "
      "`every_k_schedule=` says how many micro-batches make a window; got "
      f"{type(optimizer).__qualname__} and no every_k_schedule. Pass "
      "every_k_schedule=k, or use mode='scan', where the batch's leading axis "
      "is the window."
    )
  return MultiSteps(optimizer, every_k_schedule)


def make_train_step(
  loss_fn: Callable[..., Any],
  optimizer: MultiSteps | optax.GradientTransformation,
  *,
  mode: Mode = "stream",
  has_aux: bool = False,
  donate: bool = True,
  axis_name: AxisName | None = None,
  every_k_schedule: EveryKSchedule | None = None,
) -> TrainStep:
  """Builds a jitted train step that accumulates and always applies its update.

  ``step(params, opt_state, batch, rng=None, *, end_window=False) -> (params,
  opt_state, metrics)``
  is the only function a training loop needs: every call applies the update
  it computes (zeros inside a window), so params cannot silently stop moving
  while the optimizer state advances (F7), and nothing but the optimizer state
  decides where a window ends.

  - ``mode="stream"``: one call per micro-batch. ``end_window=True`` ends a
    window early (the last partial window of an epoch).
  - ``mode="scan"``: ``batch`` carries a leading axis of micro-batches (see
    :func:`split_micro_batches`); ``jax.lax.scan`` accumulates them and the
    optimizer runs once. The leading axis, not ``every_k_schedule``, sets the
    window; an unfinished streamed window in ``opt_state`` joins it.

  ``metrics`` holds ``loss`` (token-weighted mean loss of the window so far, or
  of the window just completed: :meth:`MultiSteps.window_loss`), ``weight``
  (its total weight), ``micro_steps``, ``updated``, ``update_count``,
  ``grad_norm`` (global norm of the gradient applied, 0 when none), the run's
  ``skipped_micro_batches`` and ``skipped_windows`` (see
  :class:`optax_accum.MultiStepsState`), ``learning_rate`` when the optimizer
  injects one (a dict by group label when several groups do: see
  :func:`get_hyperparams`), and ``aux`` with ``has_aux=True`` (stacked in scan
  mode).

  ``optimizer`` can be a plain optax optimizer: in scan mode as it is, in
  streaming mode with ``every_k_schedule=``. The step then wraps it as
  ``optax_accum.MultiSteps(optimizer, every_k_schedule)`` (``step.optimizer``)
  and ``step.init(params)`` makes the state to start from.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, weight)``, or ``(loss, (weight,
      aux))`` with ``has_aux=True``; with an ``rng`` passed to the step it is
      called as ``loss_fn(params, batch, key)`` with a key per micro-batch.
      ``loss`` is reduced as the optimizer's ``grad_reduction`` says (mean or
      sum over the micro-batch's ``weight`` items).
    optimizer: An :class:`optax_accum.MultiSteps`, or a plain optax
      ``GradientTransformation`` (see above).
    mode: ``"stream"`` (default) or ``"scan"``.
    has_aux: Whether ``loss_fn`` returns auxiliary outputs.
    donate: Donate ``params`` and ``opt_state`` buffers to the step (default).
    axis_name: The data-parallel mesh axis (or axes): each replica's loss is
      over its own rows and the step sums weights and gradients over the
      replicas. Inside ``shard_map`` or ``pmap`` it is required, and scan mode
      sums the gradients once per window (streaming, once per micro-batch).
      Under plain ``jit`` with a batch split over this axis it is optional:
      with it the step runs its programs in a ``shard_map`` over the axis and
      sums gradients once per window, in both modes (``opt_state.acc_grads``
      then holds each replica's partial sum, with a leading axis of replicas;
      ``aux`` gains a replica axis, after the micro-batch axis in scan mode);
      without it XLA sums every micro-batch's gradient. Each replica's
      ``loss_fn`` gets its own key, ``fold_in(key, replica)``.
    every_k_schedule: With a plain optax optimizer in streaming mode: the
      micro-batches per window, as :class:`MultiSteps` takes it. An error
      with a ``MultiSteps`` (it has its own) and in scan mode (the leading
      axis is the window).

  Returns:
    A :class:`TrainStep`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> def loss_fn(params, batch):
    ...   n = batch["mask"].sum()
    ...   return (batch["mask"] * (params - batch["y"]) ** 2).sum() / n, n
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.5), every_k_schedule=2)
    >>> step = optax_accum.make_train_step(loss_fn, opt)
    >>> params = jnp.zeros(())
    >>> state = opt.init(params)
    >>> batches = [{"y": jnp.array([1.0, 9.0]), "mask": jnp.array([1.0, 0.0])},
    ...            {"y": jnp.array([3.0, 3.0]), "mask": jnp.array([1.0, 1.0])}]
    >>> for batch in batches:
    ...   params, state, metrics = step(params, state, batch)
    >>> float(params), float(metrics["loss"]), bool(metrics["updated"])
    (2.3333..., 6.3333..., True)

    A plain optax optimizer in scan mode, a window of two micro-batches per
    call:

    >>> step = optax_accum.make_train_step(loss_fn, optax.sgd(0.5), mode="scan")
    >>> params = jnp.zeros(())
    >>> window = jax.tree.map(lambda *x: jnp.stack(x), *batches)
    >>> params, state, metrics = step(params, step.init(params), window)
    >>> float(params), int(metrics["update_count"])
    (2.3333..., 1)
  """
  optimizer = _accumulator(optimizer, mode, every_k_schedule)
  if axis_name is not None:
    if optimizer.axis_name not in (None, axis_name):
      raise ValueError(
        f"`axis_name` {axis_name!r} differs from the optimizer's "
        f"{optimizer.axis_name!r}."
      )
    optimizer = optimizer.with_axis_name(axis_name)
  if mode not in ("stream", "scan"):
    raise ValueError(f"`mode` must be 'stream' or 'scan', got {mode!r}.")
  if not callable(loss_fn):
    raise ValueError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
  return TrainStep(loss_fn, optimizer, mode, bool(has_aux), bool(donate))

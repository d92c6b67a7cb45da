"""``make_train_step``: a jitted accumulation step that always applies its update,
and its host side: which compiled program runs for a call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from optax_accum._core import _checks, _reduction
from optax_accum._core._hyperparams import find_states
from optax_accum._core._multi_steps import EveryKSchedule, MultiSteps, MultiStepsState
from optax_accum._core._placement import as_returned, committed, mesh_of, traced
from optax_accum._core._reduction import AxisName
from optax_accum._core._state import check_single_accumulation
from optax_accum._core._transitions import empty_window, full, with_window
from optax_accum._layouts import ONE_SUM, Layout, carried
from optax_accum._step._coupled import CoupledLoss, CoupledStep, check_coupled
from optax_accum._step._errors import (
  check_counts_keys,
  check_restored,
  check_state,
  explained,
)
from optax_accum._step._host import UNKNOWN, Host, Known, avals
from optax_accum._step._programs import (
  Bodies,
  Inputs,
  Metrics,
  Outputs,
  TwoPrograms,
  counters,
  learning_rate,
  metrics,
  whole,
)

Mode = Literal["stream", "scan"]
StepOutput = tuple[optax.Params, MultiStepsState, Metrics]


def _unaliased(donated: Any, read: Any) -> Any:
  """``donated`` with each array used twice (there or in ``read``) copied: a
  buffer cannot be donated twice, nor donated and read; hand-built states alias."""
  seen = {id(x) for x in jax.tree.leaves(read) if isinstance(x, jax.Array)}

  def fresh(x: Any) -> Any:
    if not isinstance(x, jax.Array):
      return x
    if id(x) in seen:
      return jnp.copy(x)
    seen.add(id(x))
    return x

  return jax.tree.map(fresh, donated)


class TrainStep:
  """The callable that :func:`make_train_step` returns.

  ``step(params, opt_state, batch, rng=None, *, end_window=False)`` returns
  ``(params, opt_state, metrics)``. In streaming mode one call takes one
  micro-batch; in scan mode one call takes a whole window, with the
  micro-batches along the batch's leading axis.

  Streaming runs two programs: ``accumulate_program`` adds a micro-batch
  that cannot end the window (a gradient and an add); ``update_program`` adds
  one and ends the window if it is full, running the inner optimizer at most
  once, in place (on XLA:CPU the call runs
  ``accumulate_program``, then the window's end alone:
  :class:`~optax_accum._step._programs.TwoPrograms`). Which one runs is decided
  from the state's own counters, which the host knows for the state it
  returned last (:class:`~optax_accum._step._host.Known`) and reads from
  the device otherwise, so a loop queues step after step without waiting.
  Traced in the caller's ``jit`` or ``scan`` the step runs the update
  program, correct on any micro-step.
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
    policy = _reduction.policy(optimizer.config.axis_name)
    self._bodies = Bodies(loss_fn, optimizer, has_aux, policy)
    self._host = Host(self._bodies, mode, donate)
    self.accumulate_program, update = self._host.programs(ONE_SUM)
    self.update_program = update.merged if isinstance(update, TwoPrograms) else update
    self._known: Known | None = None
    # Scan mode with the inner optimizer's own state: per params' shapes, that
    # state's structure and the counters of an empty window.
    self._empty: dict[Any, tuple[Any, MultiStepsState]] = {}

  @explained
  def __call__(
    self,
    params: optax.Params,
    opt_state: MultiStepsState,
    batch: Any,
    rng: jax.Array | None = None,
    *,
    end_window: ArrayLike = False,
  ) -> StepOutput:
    if self.mode == "scan":
      return self._whole_window(params, opt_state, batch, rng, end_window)
    check_state(opt_state)
    if end_window is not False:  # Checked on every micro-step, not only the last.
      _checks.check_scalar(end_window, name="end_window", dtype=jnp.bool_)
    counts = (opt_state.mini_step, opt_state.gradient_step, end_window)
    if any(isinstance(x, jax.core.Tracer) for x in counts):  # No tree walk.
      given = opt_state.acc_grads
      params, opt_state, layout = self._arranged(params, opt_state, batch, rng)
      params, opt_state, metrics_ = self._run_update(
        params, opt_state, batch, rng, end_window, layout=layout
      )
      return params, carried(opt_state, given), metrics_
    known, params, opt_state, hit = self._recalled(params, opt_state, batch, rng)
    value, k = known.counts(opt_state, self.optimizer)
    ends = bool(end_window) or full(value + 1, k)  # With this micro-batch.
    if ends:
      fresh = params is known.params  # Returned by the update program.
      out = self._run_update(
        params,
        opt_state,
        batch,
        rng,
        end_window,
        check_aliasing=not fresh,
        layout=known.layout,
      )
    else:
      lr = known.learning_rate
      lr = jax.tree.map(jnp.copy, learning_rate(opt_state)) if lr is UNKNOWN else lr
      known = known._replace(learning_rate=lr)
      out = self._run_accumulate(
        params, opt_state, batch, rng, lr, check_aliasing=not hit, layout=known.layout
      )
    if not isinstance(out[1].mini_step, jax.core.Tracer):  # Traced params or batch.
      self._remember(known._replace(value=value, k=k), out, ends)
    return out

  def _whole_window(
    self, params: Any, opt_state: Any, batch: Any, rng: Any, end_window: Any
  ) -> tuple[Any, Any, Metrics]:
    """Scan mode: a whole window; the optimizer's own state comes back as such."""
    _checks.check_scalar(end_window, name="end_window", dtype=jnp.bool_)
    if traced(end_window) or bool(end_window):
      raise ValueError(
        "`end_window` is for streaming: in scan mode every call ends a window."
      )
    check_restored(opt_state)
    if isinstance(opt_state, MultiStepsState):
      check_state(opt_state)
      return self._scanned(params, opt_state, batch, rng)
    check_counts_keys(opt_state, rng)
    params, state, layout = self._arranged(params, opt_state, batch, rng)
    count = _update_count(opt_state)
    if count is not None:  # The inner state's own count, as the metric's.
      state = state._replace(gradient_step=count)
      if not traced(params, state, batch):  # Placed as the programs return it.
        state = committed(state, (params, batch))
    params, state, metrics_ = self._run_update(params, state, batch, rng, layout=layout)
    if count is None:  # Nothing counts updates: no metric rather than 1 each window.
      metrics_.pop("update_count")
    return params, state.inner_opt_state, metrics_

  def _scanned(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any
  ) -> StepOutput:
    """Scan mode on a ``MultiStepsState``: the state returned last runs in its
    layout unchecked (its buffers are the programs'); others are arranged."""
    given = opt_state.acc_grads
    known, params, opt_state, _ = self._recalled(params, opt_state, batch, rng)
    fresh = params is known.params  # Returned by the last call.
    out = self._run_update(
      params, opt_state, batch, rng, check_aliasing=not fresh, layout=known.layout
    )
    if isinstance(out[1].mini_step, jax.core.Tracer):  # The layout it was given.
      return out[0], carried(out[1], given), out[2]
    self._remember(known, out, ends=True)
    return out

  def _arranged(
    self, params: Any, opt_state: Any, batch: Any, rng: Any
  ) -> tuple[Any, MultiStepsState, Layout]:
    """Params and ``opt_state`` as a call runs them, and the layout it runs in:
    the one place a state is arranged (streaming, scan mode, traced, lower)."""
    if self.mode == "scan" and not isinstance(opt_state, MultiStepsState):
      return self._own_window(params, opt_state, batch, rng)
    return self._host.arranged(params, opt_state, batch, rng)

  def _own_window(
    self, params: Any, inner: Any, batch: Any, rng: Any
  ) -> tuple[Any, MultiStepsState, Layout]:
    """The inner state in an empty window, arranged, and its layout; on one sum
    the state's sums are ``None`` (they live only inside ``Bodies.scan``)."""
    if self._host.on_one_sum(params, inner, batch):
      state = self._around(params, inner, sums=False)
      if not traced(params, state, batch):
        params, state = committed((params, state), (params, batch))
      return params, state, ONE_SUM
    state = self._around(params, inner, sums=True)  # New: the step chooses.
    return self._host.arranged(params, state, batch, rng, keep=False)

  def _around(self, params: Any, inner: Any, sums: bool) -> MultiStepsState:
    """The inner state (``tx.init(params)``) in an empty window, sums zeros or
    ``None``: in scan mode every call is a whole window, nothing else persists."""
    key = avals(params)
    if key not in self._empty:
      inner_shapes = jax.eval_shape(self.optimizer.inner_opt.init, params)
      shapes = counters(jax.eval_shape(self.optimizer.init, params))
      with jax.ensure_compile_time_eval():  # Arrays, even in the user's jit.
        empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      self._empty[key] = jax.tree.structure(inner_shapes), empty
    expected, empty = self._empty[key]  # Counters: read, never donated.
    if jax.tree.structure(inner) != expected:
      check_state(inner)  # Raises: neither a MultiStepsState nor the inner one.
    check_single_accumulation(inner)
    if not sums:
      return empty._replace(inner_opt_state=inner)
    config = self.optimizer.config
    window = empty_window(config, params)
    return with_window(config, empty, window)._replace(inner_opt_state=inner)

  def _recalled(
    self, params: Any, opt_state: MultiStepsState, batch: Any, rng: Any
  ) -> tuple[Known, Any, MultiStepsState, bool]:
    """What the host knows of ``opt_state`` (read where not), params and state
    as this call runs them, and whether the step returned the state last."""
    known = self._known
    hit = known is not None and known.returned(opt_state)
    if known is None or not hit:
      params, opt_state, layout = self._arranged(params, opt_state, batch, rng)
      known = Known(
        opt_state.mini_step, opt_state.gradient_step, None, None, None, UNKNOWN, layout
      )
    return known, params, opt_state, hit

  def _remember(self, known: Known, out: StepOutput, ends: bool) -> None:
    """Keeps what the host knows of the returned state (``known``: the given's)."""
    params, opt_state, metrics_ = out
    config = self.optimizer.config
    value = 0 if ends else (known.value or 0) + 1
    self._known = known._replace(
      mini_step=opt_state.mini_step,
      gradient_step=opt_state.gradient_step,
      acc=opt_state.acc_grads,
      value=value if config.counts_every_micro_batch else None,
      k=None if ends and config.constant_k is None else known.k,
      params=params if ends else known.params,
      learning_rate=metrics_.get("learning_rate") if ends else known.learning_rate,
    )

  def init(self, params: optax.Params) -> MultiStepsState:
    """The optimizer state to start a run from: ``self.optimizer.init(params)``
    in the layout this step keeps. On one device, one sum (as
    ``opt.init(params)``); on a mesh under plain ``jit``, per-replica partial sums
    (:class:`~optax_accum.PerReplica`): over ``axis_name``'s
    axes, or on an ``Explicit`` mesh over the ``Explicit`` axes no param is
    split over. Every path keeps a state's layout (``opt.init(params)``'s
    stays one sum); a checkpoint of the step's state restores against this.
    """
    state = self.optimizer.init(params)
    mesh = mesh_of(params)
    if mesh is not None:  # Counters placed as the programs return them.
      state = as_returned(state, mesh)
    layout = self._host.init_layout(params)
    return layout.lay_out(state, params, self.optimizer.config.terms)

  def lower(
    self,
    params: optax.Params,
    opt_state: MultiStepsState,
    batch: Any,
    rng: jax.Array | None = None,
    *,
    program: Literal["accumulate", "update", "ending"] = "update",
  ) -> jax.stages.Lowered:
    """Lowers one of the step's programs for these arguments, without running it.

    For XLA's analyses (``.compile().memory_analysis()``, ``cost_analysis()``,
    ``as_text()``). ``"update"`` is the program that can end a window (in
    scan mode, the whole window's program; where a streamed window ends in
    two programs, the two as one, whose peak bounds each's);
    ``"accumulate"`` the streaming program for micro-steps that cannot;
    ``"ending"`` the second of those two (the window's end alone; the update
    program where a window ends in one).
    """
    params, opt_state, layout = self._arranged(params, opt_state, batch, rng)
    programs = self._host.programs(layout)
    inputs = _inputs(params, opt_state, batch, rng)
    if program == "accumulate" and self.mode == "stream":
      return programs.accumulate.lower(inputs._replace(inner=None))
    if program == "ending" and isinstance(programs.update, TwoPrograms):
      ends = inputs._replace(batch=None, rng=None, end_window=False)
      return programs.update.ending.lower(ends)
    scan_ending = self.mode == "scan" and program != "update"
    if program not in ("update", "ending") or scan_ending:
      raise ValueError(
        "`program` must be 'update' or, in streaming mode, 'accumulate' or "
        f"'ending'; got {program!r}."
      )
    end_window = None if self.mode == "scan" else False
    return programs.update.lower(inputs._replace(end_window=end_window))

  # -- calling the programs ------------------------------------------------

  def _metrics(self, out: Outputs) -> Metrics:
    """The program's metrics, with ``aux`` where ``loss_fn`` has one."""
    return {**out.metrics, "aux": out.aux} if self.has_aux else out.metrics

  def _run_update(
    self,
    params: Any,
    opt_state: MultiStepsState,
    batch: Any,
    rng: Any,
    end_window: Any = None,
    *,
    check_aliasing: bool = True,
    layout: Layout = ONE_SUM,
  ) -> StepOutput:
    if self.donate and check_aliasing and not traced(params, opt_state):
      params, opt_state = _unaliased((params, opt_state), (batch, rng))
    inputs = _inputs(params, opt_state, batch, rng)._replace(end_window=end_window)
    out = self._host.programs(layout).update(inputs)
    return out.params, whole(out.counters, out.inner, out.acc), self._metrics(out)

  def _run_accumulate(
    self,
    params: Any,
    opt_state: MultiStepsState,
    batch: Any,
    rng: Any,
    learning_rate: jax.Array | None,
    check_aliasing: bool = True,
    layout: Layout = ONE_SUM,
  ) -> StepOutput:
    acc = opt_state.acc_grads
    if self.donate and check_aliasing and not traced(params, acc):
      acc = _unaliased(acc, (params, opt_state.inner_opt_state, batch, rng))
    inputs = Inputs(params, None, acc, counters(opt_state), batch, rng)
    out = self._host.programs(layout).accumulate(inputs)
    state = whole(out.counters, opt_state.inner_opt_state, out.acc)
    # The counters are never donated: the metrics can share them.
    loss, grad_norm = out.metrics["loss"], out.metrics["grad_norm"]
    config = self._bodies.config
    metrics_ = metrics(config, state, state, loss, grad_norm, learning_rate)
    return params, state, self._metrics(out._replace(metrics=metrics_))


def _inputs(params: Any, opt_state: MultiStepsState, batch: Any, rng: Any) -> Inputs:
  """A program's inputs for ``opt_state`` (its inner state, sums and counters)."""
  inner, acc = opt_state.inner_opt_state, opt_state.acc_grads
  return Inputs(params, inner, acc, counters(opt_state), batch, rng)


def _with_axis_name(optimizer: MultiSteps, axis_name: AxisName | None) -> MultiSteps:
  """``optimizer`` summing over ``axis_name`` (which must agree with its own)."""
  if axis_name is None:
    return optimizer
  if optimizer.axis_name not in (None, axis_name):
    raise ValueError(
      f"`axis_name` {axis_name!r} differs from the optimizer's {optimizer.axis_name!r}."
    )
  return optimizer.replace(axis_name=axis_name)


#: Optax states that count the updates applied, in order of preference.
_COUNTING = (
  optax.InjectStatefulHyperparamsState,
  optax.InjectHyperparamsState,
  optax.ScaleByAdamState,
  optax.ScaleByScheduleState,
)


def _update_count(inner: Any) -> jax.Array | None:
  """The update count an inner optimizer's state keeps, if any (int32)."""
  for kind in _COUNTING:
    found = find_states(inner, (kind,))
    if found:
      return jnp.asarray(found[0].count, jnp.int32)
  return None


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
      "every_k_schedule=k (or 'end_window' when your loop ends every window "
      "with end_window=True), or use mode='scan', where the batch's leading "
      "axis is the window."
    )
  return MultiSteps(optimizer, every_k_schedule)


def make_train_step(
  loss_fn: Callable[..., Any] | CoupledLoss,
  optimizer: MultiSteps | optax.GradientTransformation,
  *,
  mode: Mode = "stream",
  has_aux: bool = False,
  donate: bool = True,
  axis_name: AxisName | None = None,
  every_k_schedule: EveryKSchedule | None = None,
) -> TrainStep | CoupledStep:
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
  :func:`get_hyperparams`), ``noise_scale`` with ``MultiSteps(noise_scale=True)``
  (the window's estimates: ``docs/noise_scale.md``), and ``aux`` with
  ``has_aux=True`` (stacked in scan mode).

  ``optimizer`` can be a plain optax optimizer: in scan mode as it is, in
  streaming mode with ``every_k_schedule=``. The step then wraps it as
  ``optax_accum.MultiSteps(optimizer, every_k_schedule)`` (``step.optimizer``)
  and ``step.init(params)`` makes the state to start from.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, weight)``, or ``(loss, (weight,
      aux))`` with ``has_aux=True``; with an ``rng`` passed to the step it is
      called as ``loss_fn(params, batch, key)`` with a key per micro-batch.
      Or a :class:`CoupledLoss`, a loss that couples the window's
      micro-batches (scan mode; ``docs/coupled.md``).
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
      micro-batches per window, as :class:`MultiSteps` takes it
      (``"end_window"``: every window ends on ``end_window=True``). An error
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
  if isinstance(loss_fn, CoupledLoss):
    check_coupled(has_aux)
    acc = _with_axis_name(_accumulator(optimizer, mode, every_k_schedule), axis_name)
    build = lambda f, opt: TrainStep(f, opt, "scan", False, donate)  # noqa: E731
    return CoupledStep(loss_fn, acc, build, mode, donate)
  optimizer = _with_axis_name(
    _accumulator(optimizer, mode, every_k_schedule), axis_name
  )
  _checks.one_of(mode, ("stream", "scan"), name="mode")
  _checks.callable_arg(loss_fn, name="loss_fn")
  return TrainStep(loss_fn, optimizer, mode, bool(has_aux), bool(donate))

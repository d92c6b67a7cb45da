"""``make_train_step``: a jitted accumulation step that always applies its update,
and its host side: which compiled program runs for a call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from optax_accum._core import _checks, _reduction
from optax_accum._core._hyperparams import find_states
from optax_accum._core._multi_steps import EveryKSchedule, MultiSteps, MultiStepsState
from optax_accum._core._placement import as_returned, mesh_of, traced
from optax_accum._core._reduction import AxisName
from optax_accum._core._state import check_single_accumulation
from optax_accum._core._transitions import empty_window, full, with_window
from optax_accum._layouts import ONE_SUM, Layout, carried, for_init
from optax_accum._step import _errors, _programs
from optax_accum._step._coupled import CoupledLoss, CoupledStep
from optax_accum._step._host import UNKNOWN, Known, Layouts, avals
from optax_accum._step._programs import Bodies, Metrics, TwoPrograms

Mode = Literal["stream", "scan"]
StepOutput = tuple[optax.Params, MultiStepsState, Metrics]
ProgramName = Literal["accumulate", "update", "ending"]


class Call(NamedTuple):
  """A call's inputs as its program runs them (``TrainStep._prepared``)."""

  params: Any
  state: MultiStepsState  # In the call's layout, placed as the programs return it.
  batch: Any
  rng: Any
  end_window: Any  # Streaming's flag; ``None`` in scan mode.
  layout: Layout
  known: Known | None = None  # ``None``: nothing to remember (traced, own state).
  fresh: tuple[str, ...] = ()  # The programs whose donated buffers are programs'
  # outputs (the state returned last; its params the update program's): no copies.
  given: Any = None  # The given sums: a traced call returns its state in their layout.
  own: bool = False  # Scan mode on the inner optimizer's own state, and the
  inner_count: jax.Array | None = None  # updates it counts (``None``: it counts none).


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

  A call prepares its inputs once (``_prepared``), chooses a program
  (``_chosen``), runs it (``_run``) and returns (``_returned``).
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    optimizer: MultiSteps,
    mode: Mode,
    has_aux: bool,
    donate: bool,
  ):
    self.loss_fn, self.optimizer, self.mode = loss_fn, optimizer, mode
    self.has_aux, self.donate = has_aux, donate
    policy = _reduction.policy(optimizer.config.axis_name)
    self._bodies = Bodies(loss_fn, optimizer, has_aux, policy)
    self._layouts = Layouts(self._bodies, mode, donate)
    self.accumulate_program, update = self._layouts.programs(ONE_SUM)
    self.update_program = update.merged if isinstance(update, TwoPrograms) else update
    self._known: Known | None = None
    # Scan mode with the inner optimizer's own state: per params' shapes, that
    # state's structure and the counters of an empty window.
    self._empty: dict[Any, tuple[Any, MultiStepsState]] = {}

  @_errors.explained
  def __call__(
    self,
    params: optax.Params,
    opt_state: MultiStepsState,
    batch: Any,
    rng: jax.Array | None = None,
    *,
    end_window: ArrayLike = False,
  ) -> StepOutput:
    call = self._prepared(params, opt_state, batch, rng, end_window)
    program, known = self._chosen(call)
    return self._returned(call, self._run(call, program, known), program, known)

  def _prepared(
    self, params: Any, opt_state: Any, batch: Any, rng: Any, end_window: Any
  ) -> Call:
    """The one place a call's inputs are checked and arranged: scan mode's inner
    state put into an empty window, a state the step did not return laid out
    again and placed (``Layouts.arranged``); the one it returned last runs as it
    came back, without a tree walk."""
    _errors.check_end_window(end_window, scan=self.mode == "scan")
    end_window = None if self.mode == "scan" else end_window
    if self.mode == "scan" and not isinstance(opt_state, MultiStepsState):
      _errors.check_restored(opt_state)
      _errors.check_counts_keys(opt_state, rng)
      # One sum: its sums only inside the program (none in the state); else the
      # step chooses the layout for the call's devices.
      one_sum = self._layouts.on_one_sum(params, opt_state, batch)
      state, count = self._around(params, opt_state, sums=not one_sum)
      params, state, layout = self._layouts.arranged(
        params, state, batch, rng, keep=one_sum
      )
      return Call(params, state, batch, rng, None, layout, own=True, inner_count=count)
    known, given = self._known, getattr(opt_state, "acc_grads", None)
    if known is not None and known.returned(opt_state) and not traced(end_window):
      fresh = ("accumulate", "update") if params is known.params else ("accumulate",)
      args = (params, opt_state, batch, rng, end_window, known.layout, known)
      return Call(*args, fresh, given)  # Checked when it was first given.
    _errors.check_state(opt_state)
    # No walk of the state's tree.
    in_trace = traced(opt_state.mini_step, opt_state.gradient_step, end_window)
    params, state, layout = self._layouts.arranged(params, opt_state, batch, rng)
    # Traced: no known state, the update program, correct on any micro-step.
    known = (
      None if in_trace else Known(state.mini_step, state.gradient_step, layout=layout)
    )
    return Call(params, state, batch, rng, end_window, layout, known, given=given)

  def _chosen(self, call: Call) -> tuple[ProgramName, Known | None]:
    """The program a call runs (``"update"`` may end the window), and what the
    host then knows of the state it was given."""
    known = call.known
    if self.mode == "scan" or known is None:
      return "update", known
    value, k = known.counts(call.state, self.optimizer)
    if bool(call.end_window) or full(value + 1, k):  # With this micro-batch.
      return "update", known._replace(value=value, k=k)
    lr = known.learning_rate
    if lr is UNKNOWN:
      lr = jax.tree.map(jnp.copy, _programs.learning_rate(call.state))
    return "accumulate", known._replace(value=value, k=k, learning_rate=lr)

  def _run(self, call: Call, name: ProgramName, known: Known | None) -> StepOutput:
    """Runs the call's program ``name``: its params, state and metrics (with
    ``aux`` where ``loss_fn`` has one)."""
    unalias = self.donate and name not in call.fresh
    pair = self._layouts.programs(call.layout)
    params, state, out = _programs.run(pair, name, call, unalias)
    metrics = out.metrics
    if name != "update":  # The counters are never donated: the metrics share them.
      loss, norm = metrics["loss"], metrics["grad_norm"]
      lr = None if known is None else known.learning_rate
      metrics = _programs.metrics(self._bodies.config, state, state, loss, norm, lr)
    return params, state, {**metrics, "aux": out.aux} if self.has_aux else metrics

  def _returned(
    self, call: Call, out: StepOutput, name: ProgramName, known: Known | None
  ) -> StepOutput:
    """What the call returns; keeps what the host knows of the returned state."""
    params, state, metrics = out
    if call.own:  # The optimizer's own state comes back as such.
      if call.inner_count is None:  # Nothing counts updates: no metric, not 1 a window.
        metrics.pop("update_count")
      return params, state.inner_opt_state, metrics
    if traced(state.mini_step):  # Traced: its sums back in the layout they came in.
      return params, carried(state, call.given), metrics
    if known is not None:
      ends, config = name == "update", self.optimizer.config
      value = 0 if ends else (known.value or 0) + 1
      self._known = Known(
        state.mini_step,
        state.gradient_step,
        value if config.counts_every_micro_batch else None,
        None if ends and config.constant_k is None else known.k,
        params if ends else known.params,
        metrics.get("learning_rate") if ends else known.learning_rate,
        known.layout,
        state.acc_grads,
      )
    return out

  def _around(self, params: Any, inner: Any, sums: bool) -> tuple[MultiStepsState, Any]:
    """The inner state (``tx.init(params)``) in an empty window, sums zeros or
    ``None`` (they live only inside ``Bodies.scan``), counting the updates as
    the inner state does where it does, and that count (or ``None``)."""
    key = avals(params)
    if key not in self._empty:
      inner_shapes = jax.eval_shape(self.optimizer.inner_opt.init, params)
      shapes = _programs.counters(jax.eval_shape(self.optimizer.init, params))
      with jax.ensure_compile_time_eval():  # Arrays, even in the user's jit.
        empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      self._empty[key] = jax.tree.structure(inner_shapes), empty
    expected, state = self._empty[key]  # Counters: read, never donated.
    if jax.tree.structure(inner) != expected:
      _errors.check_state(inner)  # Raises: neither a MultiStepsState nor the inner one.
    check_single_accumulation(inner)
    if sums:
      config = self.optimizer.config
      state = with_window(config, state, empty_window(config, params))
    count = _update_count(inner)  # The inner state's own, as the metric's.
    step = state.gradient_step if count is None else count
    return state._replace(gradient_step=step, inner_opt_state=inner), count

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
    if mesh_of(params) is not None:  # Counters placed as the programs return them.
      state = as_returned(state, params)
    return self._layouts.lay_out(state, for_init(params, self._bodies.config), params)

  def lower(
    self,
    params: optax.Params,
    opt_state: MultiStepsState,
    batch: Any,
    rng: jax.Array | None = None,
    *,
    program: ProgramName = "update",
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
    names = ("update",) if self.mode == "scan" else ("accumulate", "update", "ending")
    if program not in names:
      raise ValueError(
        "`program` must be 'update' or, in streaming mode, 'accumulate' or "
        f"'ending'; got {program!r}."
      )
    call = self._prepared(params, opt_state, batch, rng, False)
    pair = self._layouts.programs(call.layout)
    lowered, inputs = _programs.select(pair, program, call)
    return lowered.lower(inputs)


def _with_axis_name(optimizer: MultiSteps, axis_name: AxisName | None) -> MultiSteps:
  """``optimizer`` summing over ``axis_name`` (which must agree with its own)."""
  if axis_name is not None and optimizer.axis_name not in (None, axis_name):
    raise ValueError(
      f"`axis_name` {axis_name!r} differs from the optimizer's {optimizer.axis_name!r}."
    )
  return optimizer if axis_name is None else optimizer.replace(axis_name=axis_name)


#: Optax states that count the updates applied, in order of preference.
_COUNTING = (
  optax.InjectStatefulHyperparamsState,
  optax.InjectHyperparamsState,
  optax.ScaleByAdamState,
  optax.ScaleByScheduleState,
)


def _update_count(inner: Any) -> jax.Array | None:
  """The update count an inner optimizer's state keeps, if any (int32)."""
  first = next((s for kind in _COUNTING for s in find_states(inner, (kind,))), None)
  # Shapes only (``lower``): the empty window's counter stands in.
  if first is None or isinstance(first.count, jax.ShapeDtypeStruct):
    return None
  return jnp.asarray(first.count, jnp.int32)


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
  _checks.one_of(mode, ("stream", "scan"), name="mode")
  acc = _with_axis_name(_accumulator(optimizer, mode, every_k_schedule), axis_name)
  if isinstance(loss_fn, CoupledLoss):
    if has_aux:
      raise ValueError(
        "A CoupledLoss takes no has_aux: its window loss returns (loss, weight)."
      )
    build = lambda f, opt: TrainStep(f, opt, "scan", False, donate)  # noqa: E731
    return CoupledStep(loss_fn, acc, build, mode, donate)
  _checks.callable_arg(loss_fn, name="loss_fn")
  return TrainStep(loss_fn, acc, mode, bool(has_aux), bool(donate))

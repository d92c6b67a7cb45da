"""The train step's programs: their one signature (every program, accumulate,
update, scan and ending, in every accumulator layout maps :class:`Inputs` to
:class:`Outputs`; a layout changes fields, ``acc`` and ``aux``, never
positions), the bodies (:class:`Bodies`), and :func:`programs`, which jits
them for a layout."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from optax_accum._core import _checks, _ending, _reduction, _transitions, _window
from optax_accum._core._backend import compiler_options, two_programs
from optax_accum._core._hyperparams import get_hyperparams
from optax_accum._core._multi_steps import MultiSteps, MultiStepsConfig, MultiStepsState
from optax_accum._core._noise import metric as noise_metric
from optax_accum._core._placement import concrete, traced
from optax_accum._layouts import Body, Layout, Sharded, inside, outside, renamed

Metrics = dict[str, Any]
State = MultiStepsState


class Inputs(NamedTuple):
  """A program's inputs (or anything laid out like them: their specs)."""

  params: Any
  inner: Any  # The inner optimizer's state; ``None`` for accumulate.
  acc: Any  # The window's sums, in the call's layout.
  counters: Any  # The state without params-sized parts; never donated.
  batch: Any  # The micro-batch (scan mode: the window's).
  rng: Any  # The run's key, or ``None``.
  end_window: Any = None  # Whether the caller ends the window (streaming update).


class Outputs(NamedTuple):
  """A program's outputs, ``metrics`` without ``aux``; accumulate's have ``None``
  params and inner, and only ``loss`` and ``grad_norm`` as metrics."""

  params: Any
  inner: Any
  acc: Any
  counters: Any
  metrics: Any
  aux: Any


#: The fields each program donates: those it returns, updated in place.
ACCUMULATE_DONATES = ("acc",)
UPDATE_DONATES = ("params", "inner", "acc")


class Program:
  """``body`` jitted field by field, so ``donates`` can be donated, in the
  ``shard_map`` of ``sharded`` where it has one. Built in ``compiled_with``,
  it compiles with those XLA options when called from Python (JAX honours
  them on a top-level jit only)."""

  def __init__(
    self, body: Body, donates: tuple[str, ...], donate: bool, sharded: Sharded | None
  ):
    fn = renamed(lambda *fields: body(Inputs(*fields)), body)  # What jit logs.
    if sharded is not None:  # Split: the accumulator, rows and aux; the rest whole.
      ins = (P(), P(), sharded.acc, P(), sharded.rows, P(), P())
      outs = Outputs(P(), P(), sharded.acc, P(), P(), sharded.aux)
      axes = set(sharded.axes)
      fn = jax.shard_map(
        fn, mesh=sharded.mesh, in_specs=ins, out_specs=outs, axis_names=axes
      )
    argnums = tuple(Inputs._fields.index(name) for name in donates) if donate else ()
    jit = functools.partial(jax.jit, fn, donate_argnums=argnums)
    self.nested, options = jit(), compiler_options()
    self.jitted = self.nested if options is None else jit(compiler_options=options)
    self._jit = functools.partial(jit, compiler_options=options)
    self._returns = (*donates, "counters")  # What it returns of its inputs.
    self._as_given: dict[Any, Any] = {}

  def __call__(self, inputs: Inputs) -> Outputs:
    if self.jitted is not self.nested:  # Options: a traced call runs nested.
      firsts = [jax.tree.leaves(tree)[:1] for tree in (inputs.params, inputs.batch)]
      if traced(inputs.counters, firsts):  # Counters, first param, first batch.
        return Outputs(*self.nested(*inputs))
    return Outputs(*self._for(inputs)(*inputs))

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self._for(inputs).lower(*inputs)

  def _for(self, inputs: Inputs) -> Any:
    """The program for ``inputs``: on a mesh of several devices (by the counters,
    placed there with the state: no tree walk), one returning what it returns of
    them (params, the inner state, sums, counters) placed as they came, leaf by
    leaf (else XLA chooses: a replicated norm scale came back split)."""
    probe = getattr(inputs.counters, "mini_step", None)
    sharding = _sharding(probe) if concrete(probe) else None
    if sharding is None or sharding.mesh.size <= 1:
      return self.jitted
    returned = {n: jax.tree.map(_sharding, getattr(inputs, n)) for n in self._returns}
    given = Outputs(None, None, None, None, None, None)._replace(**returned)
    leaves, treedef = jax.tree.flatten(given)
    if (key := (tuple(leaves), treedef)) not in self._as_given:
      self._as_given[key] = self._jit(out_shardings=given)
    return self._as_given[key]


def _sharding(x: Any) -> Any:
  """``x``'s ``NamedSharding``, else ``None`` (the compiler chooses)."""
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None


class Pair(NamedTuple):
  """A layout's ``accumulate`` and ``update`` (may end the window) programs."""

  accumulate: Any
  update: Any


class TwoPrograms:
  """The update program run as ``accumulate`` then ``ending``: on XLA:CPU, where
  a dispatch costs as much as the work, faster, and the gradient compiles once.
  :meth:`lower` gives ``merged`` (one program), whose peak bounds each's."""

  def __init__(self, accumulate: Any, ending: Any, merged: Any):
    self.accumulate, self.ending, self.merged = accumulate, ending, merged

  def __call__(self, inputs: Inputs) -> Outputs:
    added = self.accumulate(inputs._replace(inner=None, end_window=None))
    ends = inputs._replace(acc=added.acc, counters=added.counters, batch=None)
    return self.ending(ends._replace(rng=None))._replace(aux=added.aux)

  def lower(self, inputs: Inputs) -> jax.stages.Lowered:
    return self.merged.lower(inputs)


def _unaliased(inputs: Inputs, donates: tuple[str, ...], *read: Any) -> Inputs:
  """``inputs`` with each array in a donated field used twice (there, in the
  fields read or in ``read``) copied: a buffer cannot be donated twice, nor
  donated and read; hand-built states alias."""
  read = (*read, *(getattr(inputs, n) for n in Inputs._fields if n not in donates))
  seen = {id(x) for x in jax.tree.leaves(read) if isinstance(x, jax.Array)}

  def once(x: Any) -> Any:
    if isinstance(x, jax.Array) and id(x) in seen:
      return jnp.copy(x)
    seen.add(id(x))
    return x

  return inputs._replace(**{n: jax.tree.map(once, getattr(inputs, n)) for n in donates})


def select(
  pair: Pair, name: str, call: Any, unalias: bool = False
) -> tuple[Any, Inputs]:
  """``pair``'s program ``name`` (``"accumulate"``, ``"update"``, ``"ending"``:
  the update program where a window ends in one) and its inputs from
  ``call``'s params, state, batch, rng and end_window (``unalias``: each
  donated array used twice copied)."""
  state, ends = call.state, name != "accumulate"  # Accumulate: no inner, no flag.
  inner, acc = state.inner_opt_state, inside(state.acc_grads)
  fields = call.params, inner if ends else None, acc, counters(state), call.batch
  inputs = Inputs(*fields, call.rng, call.end_window if ends else None)
  if unalias and not traced(inputs):  # Accumulate reads the inner state too.
    donates, read = (UPDATE_DONATES, ()) if ends else (ACCUMULATE_DONATES, (inner,))
    inputs = _unaliased(inputs, donates, *read)
  if name == "ending" and isinstance(pair.update, TwoPrograms):
    return pair.update.ending, inputs._replace(batch=None, rng=None, end_window=False)
  return (pair.update if ends else pair.accumulate), inputs


def run(pair: Pair, name: str, call: Any, unalias: bool) -> tuple[Any, Any, Outputs]:
  """Runs :func:`select`'s program: params and state as it returns them (the
  accumulate program's, params and inner state as given), and its outputs."""
  program, inputs = select(pair, name, call, unalias)
  out = program(inputs)
  acc = outside(out.acc, call.state.acc_grads)
  if name == "accumulate":
    return call.params, whole(out.counters, call.state.inner_opt_state, acc), out
  return out.params, whole(out.counters, out.inner, acc), out


def micro_batch_key(rng: jax.Array, seen: Any, axes: tuple[str, ...]) -> jax.Array:
  """The key of the run's ``seen``-th micro-batch: ``fold_in(rng, seen)``,
  whatever became of the micro-batches before it; each replica draws its own
  for its own rows (``fold_in`` of its index over ``axes``)."""
  key = jax.random.fold_in(rng, seen)
  return jax.random.fold_in(key, _reduction.replica_index(axes)) if axes else key


def counters(state: State) -> State:
  """``state`` without its params-sized parts: the counters and window totals,
  never donated (the metrics a step returns can share them)."""
  return state._replace(inner_opt_state=None, acc_grads=None)


def whole(counters: State, inner: Any, acc: Any) -> State:
  """The state :func:`counters` split, whole again."""
  return counters._replace(inner_opt_state=inner, acc_grads=acc)


def without_sums(config: MultiStepsConfig, state: State) -> State:
  """``state`` without its sums (``None`` in each term's place): what reads the
  window's totals, and the window's end where the sums it resets go unused."""
  names = config.terms
  return state._replace(acc_grads=None if names is None else (None,) * len(names))


def learning_rate(state: State) -> Any:
  """The injected learning rate, a dict of them by group, or ``None``."""
  try:
    return get_hyperparams(state).get("learning_rate")
  except ValueError:  # No injected hyperparameters.
    return None


def metrics(
  config: MultiStepsConfig, added: State, new: State, loss: Any, norm: Any, lr: Any
) -> Metrics:
  """The step's metrics (per term under ``"terms"``); never reads the sums."""
  window = _transitions.window_of(config, without_sums(config, added))
  out: Metrics = {
    "loss": loss,
    "weight": _window.weight(window),
    "micro_steps": added.mini_step,
    "updated": new.updated,
    "update_count": new.gradient_step,
    "grad_norm": norm,
    "skipped_micro_batches": new.skipped_micro_batches,
    "skipped_windows": new.skipped_windows,
  }
  if lr is not None:
    out["learning_rate"] = lr
  if config.noise_scale:
    out["noise_scale"] = noise_metric(new.noise_scale, new.updated)
  if config.terms is not None:
    out["terms"] = _window.term_metrics(window, config.terms)
  return out


class Bodies:
  """A train step's in-graph bodies under one reduction policy (with
  ``at_window_end``, the accumulator is this replica's partial sum)."""

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    optimizer: MultiSteps,
    has_aux: bool,
    reduction: _reduction.Reduction,
  ):
    self.loss_fn, self.optimizer, self.has_aux = loss_fn, optimizer, has_aux
    self.config, self.reduction = optimizer.config, reduction

  def under(self, reduction: _reduction.Reduction) -> Bodies:
    """These bodies under another reduction policy."""
    return Bodies(self.loss_fn, self.optimizer, self.has_aux, reduction)

  # -- one micro-batch -------------------------------------------------------

  def _add(
    self, params: Any, state: State, batch: Any, rng: Any, reduction: Any = None
  ) -> tuple[State, jax.Array, Any]:
    """A micro-batch's gradient, loss, weight (by term with terms) and aux, added
    (by default under the step's ``reduction``); whether it counted, and its aux."""
    axes, seen = self.reduction.axes, state.micro_batches_seen
    args = (batch,) if rng is None else (batch, micro_batch_key(rng, seen, axes))
    cast = self.reduction.cast_params(params)
    if self.config.terms is None:
      loss = jax.value_and_grad(self._loss_parts, has_aux=True)
      (value, (weight, aux)), grads = loss(cast, args)
    else:
      grads, value, weight, aux = self._term_grads(cast, args)
    _reduction.check_named_axes(self.config.axis_name, axes, "The train step")
    reduction = self.reduction if reduction is None else reduction
    added, counted = _transitions.add_micro_batch(
      self.config, state, grads, params, weight=weight, loss=value, reduction=reduction
    )
    return added, counted, aux

  def _term_grads(self, params: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Each term's gradient, value and weight (tuples, in order), a backward pass
    per term: one pass with cotangent 0 for the others would turn a term's NaN
    (0/0 at weight 0) into NaN everywhere (0 * NaN). XLA runs the forward once."""
    names = self.config.terms or ()

    def value(p: Any, i: int) -> tuple[Any, Any]:
      terms, aux = self._term_parts(self.loss_fn(p, *args))
      values = tuple(terms[n][0] for n in names)
      return values[i], (values, tuple(terms[n][1] for n in names), aux)

    passes = [jax.grad(value, has_aux=True)(params, i) for i in range(len(names))]
    values, weights, aux = passes[-1][1]  # The same in every pass.
    return tuple(grad for grad, _ in passes), values, weights, aux

  def _term_parts(self, out: Any) -> tuple[dict[str, Any], Any]:
    """The dict of terms ``{name: (value, weight)}`` and the aux, checked."""
    terms, aux = out if self.has_aux and isinstance(out, tuple) else (out, None)
    if not isinstance(terms, dict) or set(terms) != set(self.config.terms or ()):
      got = sorted(terms) if isinstance(terms, dict) else type(terms).__name__
      want = "({name: (value, weight)}, aux)" if self.has_aux else "a dict"
      raise ValueError(
        f"`loss_fn` must return {want} with one (value, weight) pair per loss "
        f"term {list(self.config.terms or ())} (MultiSteps(terms=...)), got {got}."
      )
    for name, pair in terms.items():
      if not (isinstance(pair, tuple) and len(pair) == 2):
        raise ValueError(
          f"`loss_fn`'s term {name!r} must be a (value, weight) pair, got "
          f"{type(pair).__name__}."
        )
    return terms, aux

  def _loss_parts(self, params: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
    """``loss_fn``'s loss, and its weight and aux, checked."""
    has_aux, out = self.has_aux, self.loss_fn(params, *args)
    value, rest = out if isinstance(out, tuple) and len(out) == 2 else (None, None)
    if isinstance(out, dict):
      got = f"a dict of loss terms {sorted(out)}: declare them with MultiSteps(..., "
      got += "terms=(...)) to keep each term's own weight"
    elif not (isinstance(out, tuple) and len(out) == 2):
      got = _checks.describe_output(out)
    elif has_aux and not (isinstance(rest, tuple) and len(rest) == 2):
      got = f"(loss, {_checks.describe_output(rest)})"
    elif not has_aux and isinstance(rest, tuple | list | dict):
      got = f"(loss, {type(rest).__name__}): set has_aux=True?"
    else:
      return (value, rest) if has_aux else (value, (rest, None))
    want = "(loss, (weight, aux))" if has_aux else "(loss, weight)"
    raise ValueError(f"`loss_fn` must return {want} with has_aux={has_aux}, got {got}.")

  # -- the programs (Inputs to Outputs) ---------------------------------------

  def accumulate(self, inputs: Inputs) -> Outputs:
    """Adds a micro-batch that cannot end the window."""
    state = whole(inputs.counters, None, inputs.acc)
    added, _, aux = self._add(inputs.params, state, inputs.batch, inputs.rng)
    # Typed as the update's norm: the window weight's dtype.
    dtype = jnp.result_type(*jax.tree.leaves(added.acc_weight))
    out = {"loss": self.optimizer.window_loss(added), "grad_norm": jnp.zeros([], dtype)}
    return Outputs(None, None, added.acc_grads, counters(added), out, aux)

  def update(self, inputs: Inputs) -> Outputs:
    """Adds a micro-batch and ends the window if it is full or ``end_window``."""
    state = whole(inputs.counters, inputs.inner, inputs.acc)
    added, counted, aux = self._add(inputs.params, state, inputs.batch, inputs.rng)
    return self._ended(inputs, added, counted, aux)

  def ending(self, inputs: Inputs) -> Outputs:
    """:meth:`update`'s second half, after :meth:`accumulate`; only where every
    micro-batch counts (it skips ``should_skip_update_fn``)."""
    added = whole(inputs.counters, inputs.inner, inputs.acc)
    return self._ended(inputs, added, jnp.array(True), None)

  def _ended(self, inputs: Inputs, added: State, counted: Any, aux: Any) -> Outputs:
    """The window of ``added`` ended if it is full or ``inputs.end_window``. The
    accumulator keeps the window's sum (or this replica's partial sum): the next
    window's first micro-batch overwrites it (see _window.add)."""
    ends = _transitions.window_ends(self.config, added, counted, inputs.end_window)
    summed = added._replace(acc_grads=self.reduction.window_gradient(added.acc_grads))
    return self._end(summed, ends, inputs.params, added.acc_grads, aux)

  def scan(self, inputs: Inputs) -> Outputs:
    """A whole window, micro-batches along the batch's leading axis. Replicas sum
    their own, reduced once after the loop; a streamed part in ``acc`` joins then.
    ``acc`` ``None``: an empty window, its sums neither read nor returned (each
    buffer costs host time per call)."""
    params, acc, batch = inputs.params, inputs.acc, inputs.batch
    _check_leading_axis(batch, self.config)
    axes, partial = self.reduction.axes, self.reduction.at_window_end
    loop = self.reduction.per_window()
    if empty := acc is None:
      window = _transitions.empty_window(self.config, params)
      acc = _window.as_state_fields(window, self.config.terms).acc_grads
    own = axes and (empty or not partial)
    start = jax.tree.map(lambda x: loop.own(jnp.zeros_like(x)), acc) if own else acc

    def body(state: State, micro_batch: Any) -> Any:
      added, _, aux = self._add(params, state, micro_batch, inputs.rng, loop)
      return added, aux

    added, auxs = jax.lax.scan(body, whole(inputs.counters, None, start), batch)
    window = loop.window_gradient(added.acc_grads)  # From the partial sums.
    if axes and not partial and not empty:
      streamed = inputs.counters.mini_step > 0
      window = jax.tree.map(
        lambda total, a: total + jnp.where(streamed, a, jnp.zeros_like(a)), window, acc
      )
    summed = added._replace(acc_grads=window, inner_opt_state=inputs.inner)
    sums = None if empty else added.acc_grads if partial else window
    return self._end(summed, jnp.array(True), params, sums, auxs)

  def _end(self, summed: State, ends: Any, params: Any, sums: Any, aux: Any) -> Outputs:
    """Ends the window of ``summed`` (its gradient reduced) if ``ends``: params
    (in place), the inner state, ``sums`` (what the accumulator keeps), counters,
    metrics and ``aux``."""
    loss = self.optimizer.window_loss(summed)
    done = _ending.end(  # The accumulator keeps the sums: no reset to trace.
      self.config,
      self.optimizer.inner_opt,
      without_sums(self.config, summed),
      ends,
      sums=summed.acc_grads,
      params=params,
      like=params,
      reduction=self.reduction,
      loss=loss,
      extra_args={"value": loss},
      apply_to_params=True,
    )
    new = done.state
    out = metrics(self.config, summed, new, loss, done.norm, learning_rate(new))
    return Outputs(done.target, new.inner_opt_state, sums, counters(new), out, aux)


def _check_leading_axis(batch: Any, config: MultiStepsConfig) -> None:
  """``ValueError`` unless batch leaves share one leading axis, or where its size
  is a multiple of an int ``every_k_schedule`` ``k > 1`` beyond ``k`` itself:
  likely a batch not split into micro-batches yet (other sizes set the window)."""
  sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
  if len(sizes) != 1 or None in sizes or 0 in sizes:
    raise ValueError(
      "In scan mode every `batch` leaf needs the same leading micro-batch axis "
      f"of size >= 1, got leading sizes {sorted(map(str, sizes))}."
    )
  k, size = config.every_k_schedule, np.shape(jax.tree.leaves(batch)[0])[0]
  if isinstance(k, int | np.integer) and 1 < k < size and size % k == 0:
    raise ValueError(
      "In scan mode the batch's leading axis is the window's micro-batches: "
      f"every `batch` leaf has {size} along it, {size // k} times "
      f"`every_k_schedule`={k}: a batch not split yet? Stack it as {k} "
      f"micro-batches: optax_accum.split_micro_batches(batch, {k}); for windows "
      "of any length, MultiSteps(..., every_k_schedule='end_window')."
    )


def programs(layout: Layout, bodies: Bodies, *, scan: bool, donate: bool) -> Pair:
  """``bodies``' accumulate and update programs for ``layout`` (scan: the window's)."""
  policy = layout.reduction
  bodies = bodies if policy is None else bodies.under(policy)

  def program(body: Body, donates: tuple[str, ...], window: bool = False) -> Program:
    return Program(layout.wrap(body, window), donates, donate, layout.sharded(window))

  accumulate = program(bodies.accumulate, ACCUMULATE_DONATES)
  update = program(bodies.scan if scan else bodies.update, UPDATE_DONATES, window=scan)
  plain = policy is None and layout.sharded(False) is None
  if not scan and two_programs(bodies.config, plain):
    ending = program(bodies.ending, UPDATE_DONATES)
    return Pair(accumulate, TwoPrograms(accumulate, ending, update))
  return Pair(accumulate, update)

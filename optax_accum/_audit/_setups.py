"""What ``audit`` runs on the accumulated side: the caller's setup, or one it builds.

An accumulator passed as ``optimizer`` (``optax.MultiSteps``,
:class:`optax_accum.MultiSteps`) is audited as the setup its users run: the
usual loop around it, with its inner optimizer on the whole-batch side. An
:class:`optax_accum.MultiSteps` inside the optimizer (``optax.chain``) is run
as written, the whole batch ending its window on every update.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import optax

from optax_accum._audit._loops import (
  STATELESS_PROBE,
  LossView,
  built_once,
  probe_optimizer,
  train_step_loop,
  usual_loop,
)
from optax_accum._core import _checks
from optax_accum._core._multi_steps import MultiSteps, MultiStepsState

#: ``accumulation(optimizer, k) -> (init, step)`` with ``init(params) -> state``
#: and ``step(params, state, micro_batch) -> (params, state)``, one call per
#: micro-batch: the user's own accumulation, built around any optimizer.
Accumulation = Callable[[optax.GradientTransformation, int], tuple[Callable, Callable]]
Accumulator: TypeAlias = MultiSteps | optax.MultiSteps
_ACCUMULATORS = (MultiSteps, optax.MultiSteps)
_STATES = (MultiStepsState, optax.MultiStepsState)


@dataclasses.dataclass(frozen=True)
class Setup:
  """The accumulated side of an audit, and the whole-batch side's optimizer.

  Attributes:
    name: How the report names the setup.
    accumulation: Builds it around an optimizer (see :data:`Accumulation`).
    optimizer: What the whole batch applies once per update.
    loss: The loss as the whole batch takes it: the token mean and the weight.
    probe: What the setup runs around to show the gradient it applies: your
      optimizer with its updates replaced by the gradient, or for the loops the
      audit builds (which read no optimizer state) a stateless one; ``None``
      where the accumulator sits inside the optimizer and cannot be swapped.
    ends_windows: Whether ``optimizer`` holds an :class:`optax_accum.MultiSteps`,
      whose window the whole batch then ends on every update
      (``end_window=True``), so members after it step once per update.
    declared: How the setup is told to weigh the micro-batches' gradients:
      ``"weight"``, by ``loss_fn``'s weight (a mean over it); ``"sum"``, 1
      each and not normalised (``grad_reduction="window_mean"``).
  """

  name: str
  accumulation: Accumulation
  optimizer: optax.GradientTransformation
  loss: LossView
  probe: optax.GradientTransformation | None
  ends_windows: bool = False
  declared: str = "weight"


def accumulator_name(acc: Any) -> str:
  return "optax_accum.MultiSteps" if isinstance(acc, MultiSteps) else "optax.MultiSteps"


def find_accumulator(optimizer: Any) -> Accumulator | None:
  """``optimizer`` itself if it is an accumulator, or the one it was made from.

  ``MultiSteps(...).gradient_transformation()`` keeps the accumulator's bound
  ``init``, so that form is recognised too.
  """
  if isinstance(optimizer, _ACCUMULATORS):
    return optimizer
  owner = getattr(getattr(optimizer, "init", None), "__self__", None)
  return owner if isinstance(owner, _ACCUMULATORS) else None


def _accumulator_states(state: Any) -> set[type]:
  """The types of the accumulator states inside ``state``."""
  nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _STATES))
  return {type(node) for node in nodes if isinstance(node, _STATES)}


def _window_size(acc: Accumulator) -> int | None:
  """The accumulator's first window size, where it can be read."""
  step0 = jnp.zeros([], jnp.int32)
  if isinstance(acc, MultiSteps):
    size = acc.k_at(step0)
  else:
    schedule, _ = _optax_private(acc)
    if not callable(schedule):
      return None
    size = schedule(step0)
  try:
    return int(size)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def _with_inner(acc: Accumulator, inner: optax.GradientTransformation) -> Accumulator:
  """A copy of ``acc``, every setting kept, around another inner optimizer."""
  if isinstance(acc, MultiSteps):
    return acc.replace(opt=inner)
  _, rewrapped = _optax_private(acc)
  return rewrapped(inner)


def _optax_private(
  acc: optax.MultiSteps,
) -> tuple[Any, Callable[[optax.GradientTransformation], optax.MultiSteps]]:
  """What ``optax.MultiSteps`` offers no public way to get: its window schedule
  (``None`` where it has none), and a copy of it around another inner
  optimizer. The audit's only use of private attributes."""

  def rewrapped(inner: optax.GradientTransformation) -> optax.MultiSteps:
    if not hasattr(acc, "_opt"):
      raise ValueError(
        f"This version of {accumulator_name(acc)} cannot be re-wrapped around "
        "the audit's probe to measure its gradient; audit it through `accumulation=` "
        "with its inner optimizer as `optimizer`."
      )
    clone = copy.copy(acc)
    clone._opt = optax.with_extra_args_support(inner)
    return clone

  return getattr(acc, "_every_k_schedule", None), rewrapped


def _describe(out: Any) -> str:
  if isinstance(out, jax.ShapeDtypeStruct):
    return f"one array of shape {out.shape}"
  if isinstance(out, tuple | list):
    return f"a {type(out).__name__} of {len(out)}"
  return type(out).__name__


def check_loss_fn(loss: LossView, params: Any, micro_batch: Any) -> None:
  """Raises ``ValueError`` unless ``loss.loss_fn`` returns what ``audit`` needs
  (loss terms are checked where they are found: ``_terms.loss_terms``)."""
  _checks.callable_arg(loss.loss_fn, name="loss_fn")
  if loss.terms:
    return
  want = "(loss, (weight, aux))" if loss.has_aux else "(loss, weight)"
  what = (
    "the loss summed over tokens (grad_reduction='sum') and the number of tokens, "
    "e.g. `return (losses * mask).sum(), mask.sum()`"
    if loss.summed
    else "the token-mean loss and the number of tokens behind it, e.g. `return "
    "(losses * mask).sum() / mask.sum(), mask.sum()`"
  )

  def fail(got: str) -> ValueError:
    return ValueError(
      f"`loss_fn` must return {want} with has_aux={loss.has_aux}, {got}: return {what}."
    )

  out = jax.eval_shape(loss.loss_fn, params, micro_batch)
  if not (isinstance(out, tuple) and len(out) == 2):
    raise fail(f"got {_describe(out)}")
  value, rest = out
  if loss.has_aux:
    if not (isinstance(rest, tuple) and len(rest) == 2):
      raise fail(f"got (loss, {_describe(rest)})")
    rest = rest[0]
  elif isinstance(rest, tuple | list | dict):
    raise fail(f"got (loss, {_describe(rest)}): set has_aux=True?")
  for name, x in (("loss", value), ("weight", rest)):
    if not isinstance(x, jax.ShapeDtypeStruct) or x.shape != ():
      raise fail(f"got a {name} that is {_describe(x)}, not a scalar")


def resolve_setup(
  loss: LossView,
  optimizer: Any,
  params: Any,
  k: int,
  accumulation: Accumulation | None,
) -> Setup:
  """What the audit runs: the caller's accumulation, an accumulator's usual loop,
  or :func:`optax_accum.make_train_step` around :class:`optax_accum.MultiSteps`
  (``terms=`` those of ``loss``, where it has terms).
  """
  acc = find_accumulator(optimizer)
  if acc is not None:
    _check_accumulator(acc, k, accumulation)
    _check_terms(acc, loss)
    return _accumulator_setup(loss, acc)
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise ValueError(
      "`optimizer` must be an optax.GradientTransformation, got "
      f"{type(optimizer).__name__}."
    )
  held = _accumulator_states(optimizer.init(params))
  if held:
    return _chained_setup(loss, optimizer, accumulation, held)
  if accumulation is not None:
    probe = probe_optimizer(optimizer)
    return Setup("your accumulation", accumulation, optimizer, loss, probe)
  loss_fn, has_aux, terms = loss.loss_fn, loss.has_aux, loss.terms or None

  def ours(opt: Any, k: int) -> tuple[Callable, Callable]:
    return built_once(
      ("ours", loss_fn, has_aux, terms, opt, k),
      lambda: train_step_loop(loss_fn, has_aux, MultiSteps(opt, k, terms=terms)),
    )

  name = "optax_accum.make_train_step (default)"
  return Setup(name, ours, optimizer, loss, STATELESS_PROBE)


def _check_terms(acc: Accumulator, loss: LossView) -> None:
  """Raises ``ValueError`` unless ``acc`` takes the loss terms ``loss_fn``
  returns (an ``optax.MultiSteps`` takes their sum)."""
  terms = loss.terms
  if not isinstance(acc, MultiSteps) or set(acc.config.terms or ()) == set(terms):
    return
  declared = list(acc.config.terms or ())
  if not terms:
    raise ValueError(
      f"The optax_accum.MultiSteps passed as `optimizer` has terms={declared} "
      "but `loss_fn` returns no dict of loss terms {name: (value, weight)} with "
      f"has_aux={loss.has_aux}: return one (with has_aux=True, `(terms, aux)`)."
    )
  raise ValueError(
    f"`loss_fn` returns the loss terms {list(terms)} but the "
    f"optax_accum.MultiSteps passed as `optimizer` has terms={declared or None}: "
    f"pass optax_accum.MultiSteps(..., terms={terms!r})."
  )


def _chained_setup(
  loss: LossView,
  optimizer: optax.GradientTransformation,
  accumulation: Accumulation | None,
  held: set[type],
) -> Setup:
  """An accumulator inside ``optimizer`` (``optax.chain(MultiSteps(...), ...)``),
  audited as written: the whole batch ends its window on every update."""
  if optax.MultiStepsState in held:
    raise ValueError(
      "`optimizer` holds an optax.MultiSteps inside another transformation "
      "(e.g. optax.chain(optax.MultiSteps(...).gradient_transformation(), ...)), "
      "which cannot end a window on demand, so the whole-batch side cannot run "
      "it once per batch. To audit the layout as written, put "
      "optax_accum.MultiSteps(opt, k) in its place (same arguments; without "
      "weights it computes the same); or pass the optimizer without the "
      "accumulator as `optimizer` and build your setup around it in "
      "`accumulation=`."
    )
  if accumulation is not None:
    name = "your accumulation (an optax_accum.MultiSteps inside the optimizer)"
    return Setup(name, accumulation, optimizer, loss, None, True)

  def usual(opt: Any, k: int) -> tuple[Callable, Callable]:
    del k  # The accumulator's own window size decides.
    return built_once(
      ("chained", loss, opt), lambda: usual_loop(loss, opt, weighted=True)
    )

  each = "each term's" if loss.terms else "each micro-batch's"
  name = (
    "your optimizer (an optax_accum.MultiSteps inside it) in the usual loop "
    f"({each} gradient and weight to update)"
  )
  return Setup(name, usual, optimizer, loss, None, True)


def _check_accumulator(
  acc: Accumulator, k: int, accumulation: Accumulation | None
) -> None:
  """Raises ``ValueError`` unless the audit can run the usual loop around ``acc``."""
  name = accumulator_name(acc)
  if accumulation is not None:
    raise ValueError(
      f"`optimizer` is an accumulator ({name}) and `accumulation` is given: "
      "the whole batch would apply the accumulator. Pass its inner optimizer "
      f"(`optimizer=acc.inner_opt`) with your `accumulation=`, or the {name} "
      "alone to audit the usual loop around it."
    )
  size = _window_size(acc)
  if size is not None and size != k:
    raise ValueError(
      f"`k`={k} but the {name} passed as `optimizer` ends windows every {size} "
      f"micro-batches: pass k={size}."
    )
  if isinstance(acc, MultiSteps) and _checks.axes(acc.axis_name):
    raise ValueError(
      f"The {name} passed as `optimizer` sums over axis {acc.axis_name!r}; the "
      "audit runs on one device: pass it without `axis_name`."
    )


def _accumulator_setup(given: LossView, acc: Accumulator) -> Setup:
  """The usual loop around ``acc``; its inner optimizer is the whole batch's.

  With ``grad_reduction="sum"`` ``loss_fn`` is the summed loss the train step
  takes, and the whole batch takes its token mean. With
  ``grad_reduction="window_mean"`` it is each micro-batch's share of the
  window's loss (summed, divided by a constant such as the window's token
  count), and the whole batch takes it as it is: the setup sums the shares'
  gradients. Loss terms go to an ``optax.MultiSteps`` as their sum.
  """
  inner = acc.inner_opt
  loss_fn, has_aux = given.loss_fn, given.has_aux
  reduction = acc.grad_reduction if isinstance(acc, MultiSteps) else "mean"
  summed = reduction == "sum"
  loss = dataclasses.replace(given, summed=summed)

  def build(opt: Any) -> tuple[Callable, Callable]:
    wrapped = acc if opt is inner else _with_inner(acc, opt)
    if isinstance(wrapped, MultiSteps):
      return train_step_loop(loss_fn, has_aux, wrapped)
    return usual_loop(loss, wrapped, weighted=False)

  def around(opt: Any, k: int) -> tuple[Callable, Callable]:
    del k  # The accumulator's own window size decides.
    return built_once(("around", loss_fn, has_aux, acc, opt), lambda: build(opt))

  name = accumulator_name(acc)
  if summed:
    name += (
      "(grad_reduction='sum') in optax_accum.make_train_step (loss_fn summed "
      "over tokens; the whole batch takes its token mean)"
    )
  elif reduction == "window_mean":
    name += (
      "(grad_reduction='window_mean') in optax_accum.make_train_step (loss_fn "
      "divided by a constant or not at all: the micro-batches' gradients summed)"
    )
  elif isinstance(acc, MultiSteps):
    name += " in optax_accum.make_train_step"
  elif loss.terms:
    name += (
      " in the usual loop (each micro-batch's gradient of the terms' sum to update)"
    )
  else:
    name += " in the usual loop (each micro-batch's gradient to update)"
  declared = "sum" if reduction == "window_mean" else "weight"
  return Setup(name, around, inner, loss, STATELESS_PROBE, declared=declared)

"""What ``audit`` runs on the accumulated side: the caller's setup, or one it builds.

An accumulator passed as ``optimizer`` (``optax.MultiSteps``,
:class:`optax_accum.MultiSteps`) is audited as the setup its users run: the
usual loop around it, with its inner optimizer on the whole-batch side.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import optax

from optax_accum import _checks
from optax_accum._multi_steps import MultiSteps, MultiStepsState
from optax_accum._train_step import make_train_step

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
  """

  name: str
  accumulation: Accumulation
  optimizer: optax.GradientTransformation


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


def _holds_accumulator_state(state: Any) -> bool:
  nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _STATES))
  return any(isinstance(node, _STATES) for node in nodes)


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
        "optax.sgd(1.0) to measure its gradient; audit it through `accumulation=` "
        "with its inner optimizer as `optimizer`."
      )
    clone = copy.copy(acc)
    clone._opt = optax.with_extra_args_support(inner)
    return clone

  return getattr(acc, "_every_k_schedule", None), rewrapped


def strip_aux(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
  """``loss_fn`` as ``(params, batch) -> (loss, weight)``."""
  if not has_aux:
    return loss_fn

  def loss(params: Any, batch: Any) -> tuple[Any, Any]:
    value, (weight, _) = loss_fn(params, batch)
    return value, weight

  return loss


def _describe(out: Any) -> str:
  if isinstance(out, jax.ShapeDtypeStruct):
    return f"one array of shape {out.shape}"
  if isinstance(out, tuple | list):
    return f"a {type(out).__name__} of {len(out)}"
  return type(out).__name__


def check_loss_fn(
  loss_fn: Callable[..., Any], has_aux: bool, params: Any, micro_batch: Any
) -> None:
  """Raises ``ValueError`` unless ``loss_fn`` returns what ``audit`` needs."""
  _checks.callable_arg(loss_fn, name="loss_fn")
  want = "(loss, (weight, aux))" if has_aux else "(loss, weight)"

  def fail(got: str) -> ValueError:
    return ValueError(
      f"`loss_fn` must return {want} with has_aux={has_aux}, {got}: return the "
      "token-mean loss and the number of tokens behind it, e.g. `return "
      "(losses * mask).sum() / mask.sum(), mask.sum()`."
    )

  out = jax.eval_shape(loss_fn, params, micro_batch)
  if not (isinstance(out, tuple) and len(out) == 2):
    raise fail(f"got {_describe(out)}")
  value, rest = out
  if has_aux:
    if not (isinstance(rest, tuple) and len(rest) == 2):
      raise fail(f"got (loss, {_describe(rest)})")
    rest = rest[0]
  elif isinstance(rest, tuple | list | dict):
    raise fail(f"got (loss, {_describe(rest)}): set has_aux=True?")
  for name, x in (("loss", value), ("weight", rest)):
    if not isinstance(x, jax.ShapeDtypeStruct) or x.shape != ():
      raise fail(f"got a {name} that is {_describe(x)}, not a scalar")


#: Setups built by the audit, newest last: auditing the same loss and optimizer
#: again (or the restart the audit simulates) reuses their compiled programs.
_BUILT: collections.OrderedDict[Hashable, tuple[Callable, Callable]] = (
  collections.OrderedDict()
)
_MAX_BUILT = 8


def _built_once(
  key: tuple[Any, ...], build: Callable[[], tuple[Callable, Callable]]
) -> tuple[Callable, Callable]:
  """``build()``, or what it returned for ``key`` before.

  Only for setups that keep nothing on the host: building them again gives
  the same functions, so reusing them spares compiling them again.
  """
  try:
    hash(key)
  except TypeError:  # An unhashable optimizer: build it every time.
    return build()
  if key in _BUILT:
    _BUILT.move_to_end(key)
    return _BUILT[key]
  _BUILT[key] = built = build()
  while len(_BUILT) > _MAX_BUILT:
    _BUILT.popitem(last=False)
  return built


def _train_step_setup(
  loss_fn: Callable[..., Any], has_aux: bool, acc: MultiSteps
) -> tuple[Callable, Callable]:
  if acc.grad_reduction == "sum":  # audit's loss_fn is a token mean.
    mean_loss = strip_aux(loss_fn, has_aux)

    def summed(params: Any, batch: Any) -> tuple[Any, Any]:
      value, weight = mean_loss(params, batch)
      return value * weight, weight

    train_step = make_train_step(summed, acc)
  else:
    train_step = make_train_step(loss_fn, acc, has_aux=has_aux)

  def step(params: Any, state: Any, micro_batch: Any) -> tuple[Any, Any]:
    params, state, _ = train_step(params, state, micro_batch)
    return params, state

  return acc.init, step


def _optax_loop(
  loss_fn: Callable[..., Any], has_aux: bool, acc: optax.MultiSteps
) -> tuple[Callable, Callable]:
  """The loop ``optax.MultiSteps`` users write: each micro-batch's mean gradient."""
  mean_loss = strip_aux(loss_fn, has_aux)

  @jax.jit
  def step(params: Any, state: Any, micro_batch: Any) -> tuple[Any, Any]:
    grads, _ = jax.grad(mean_loss, has_aux=True)(params, micro_batch)
    updates, state = acc.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return acc.init, step


def resolve_setup(
  loss_fn: Callable[..., Any],
  has_aux: bool,
  optimizer: Any,
  params: Any,
  k: int,
  accumulation: Accumulation | None,
) -> Setup:
  """What the audit runs: the caller's accumulation, an accumulator's usual loop,
  or :func:`optax_accum.make_train_step` around :class:`optax_accum.MultiSteps`.
  """
  acc = find_accumulator(optimizer)
  if acc is not None:
    _check_accumulator(acc, k, accumulation)
    return _accumulator_setup(loss_fn, has_aux, acc)
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise ValueError(
      "`optimizer` must be an optax.GradientTransformation, got "
      f"{type(optimizer).__name__}."
    )
  if _holds_accumulator_state(optimizer.init(params)):
    raise ValueError(
      "`optimizer` holds an accumulator (optax.MultiSteps or optax_accum."
      "MultiSteps) inside another transformation, so the whole-batch side "
      "cannot apply it once per batch. Pass the optimizer without the "
      "accumulator as `optimizer`, and build your setup around it in "
      "`accumulation=`."
    )
  if accumulation is not None:
    return Setup("your accumulation", accumulation, optimizer)

  def ours(opt: Any, k: int) -> tuple[Callable, Callable]:
    return _built_once(
      ("ours", loss_fn, has_aux, opt, k),
      lambda: _train_step_setup(loss_fn, has_aux, MultiSteps(opt, k)),
    )

  return Setup("optax_accum.make_train_step (default)", ours, optimizer)


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
  if isinstance(acc, MultiSteps) and acc.axis_name is not None:
    raise ValueError(
      f"The {name} passed as `optimizer` sums over axis {acc.axis_name!r}; the "
      "audit runs on one device: pass it without `axis_name`."
    )
  if isinstance(acc, MultiSteps) and acc.grad_reduction == "window_mean":
    raise ValueError(
      f"The {name} passed as `optimizer` takes grad_reduction='window_mean' "
      "losses (shares of the window's mean), which only your loop can compute; "
      "audit's `loss_fn` returns a token mean: audit it with "
      "grad_reduction='mean', or pass your loop as `accumulation=`."
    )


def _accumulator_setup(
  loss_fn: Callable[..., Any], has_aux: bool, acc: Accumulator
) -> Setup:
  """The usual loop around ``acc``; its inner optimizer is the whole batch's."""
  inner = acc.inner_opt

  def build(opt: Any) -> tuple[Callable, Callable]:
    wrapped = acc if opt is inner else _with_inner(acc, opt)
    if isinstance(wrapped, MultiSteps):
      return _train_step_setup(loss_fn, has_aux, wrapped)
    return _optax_loop(loss_fn, has_aux, wrapped)

  def around(opt: Any, k: int) -> tuple[Callable, Callable]:
    del k  # The accumulator's own window size decides.
    return _built_once(("around", loss_fn, has_aux, acc, opt), lambda: build(opt))

  how = (
    "in optax_accum.make_train_step"
    if isinstance(acc, MultiSteps)
    else "in the usual loop (each micro-batch's gradient to update)"
  )
  return Setup(f"{accumulator_name(acc)} {how}", around, inner)

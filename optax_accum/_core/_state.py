"""The state and settings of :class:`optax_accum.MultiSteps`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike, DTypeLike

from optax_accum._core import _checks, _hyperparams, _reduction

GradReduction = Literal["mean", "sum", "window_mean"]
NonFinitePolicy = Literal["skip_window", "skip_micro_batch"]
EveryKSchedule = int | Callable[[jax.Array], ArrayLike] | Literal["end_window"]
#: ``every_k_schedule`` for windows that only the caller ends (``end_window=True``).
END_WINDOW = "end_window"
_NEVER = np.iinfo(np.int32).max  # A window length no count reaches.
ShouldSkipUpdateFn = Callable[..., tuple[ArrayLike, Any]]

#: Extra argument the inner optimizer receives at the end of a window: the
#: window's total weight (items behind the emitted gradient).
WINDOW_WEIGHT = "window_weight"
#: Extra argument the inner optimizer receives at the end of a window: how many
#: micro-batches the window accumulated.
WINDOW_MICRO_STEPS = "window_micro_steps"


class StoredNode:
  """The base of a layout's stored node (``PerReplica``, ``Packed``): sums
  that are not one sum. A node is recognised by its type, never by a field's
  name, so params with a field of that name are never taken for one."""

  contents: ClassVar[str]  # What the node holds, for error messages.


def check_one_sum(acc: Any, where: str) -> None:
  """Raises ``ValueError`` unless ``acc`` is one sum (no stored node)."""
  if isinstance(acc, StoredNode):
    raise ValueError(
      f"`state` holds {acc.contents}: {where} takes one sum. Convert it with "
      "optax_accum.relayout(state, opt.init(params))."
    )


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
      holds (the window's first micro-batch overwrites it). Its pytree
      structure says its layout: laid out as the params (``init``, and a
      train step's ``step.init`` on one device) or ``PerReplica`` (each
      replica's partial sum, from ``step.init`` on a mesh);
      ``optax_accum.relayout`` converts (and turns a ``Packed`` node, restored
      from a checkpoint written before packing was removed, into one sum).
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
    micro_batches_seen: int32 ``[]``, saturating. Every micro-batch the
      accumulator has seen in the run, whatever became of it (rejected,
      dropped, of weight 0, in a skipped window). ``make_train_step`` gives
      the run's ``n``-th micro-batch the key ``jax.random.fold_in(rng, n)``
      with this count, so no two micro-batches of a run share a key (for the
      first ``2**31 - 1``).
      A state built by hand without it starts at 0.
    last_window_loss: Like ``acc_weight``. The loss of the window that ended
      last (:meth:`MultiSteps.window_loss` at its end), whether or not it
      applied an update: readable after the update, when ``acc_loss`` is
      already reset. 0 before the first window ends, or without ``loss=``.
    last_window_weight: Like ``acc_weight``. That window's total weight.
      A state built by hand (or restored) without these two starts at 0.
    noise_scale: With ``MultiSteps(noise_scale=True)``, a
      ``NoiseScaleState``: the window's running sum of its units' squared
      norms and the last window's estimates of the gradient noise scale's two
      parts (``docs/noise_scale.md``). Otherwise ``None``, and not a node of
      the pytree: a state that does not measure has the structure of
      release 0.1.0's, and its orbax checkpoints restore against it
      (``flax.serialization``: ``docs/noise_scale.md``).
    held: A streamed :class:`~optax_accum.CoupledLoss` window's micro-batches
      so far (a tuple of device copies, in order), which its last call runs
      together; ``None`` (not a node of the pytree) everywhere else.
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
  noise_scale: Any = None
  held: Any = None


_OPTIONAL = ("noise_scale", "held")  # Not nodes where None: 0.1.0's tree.
_REQUIRED = len(MultiStepsState._fields) - len(_OPTIONAL)


def _flat(state: MultiStepsState) -> tuple[tuple[Any, ...], tuple[str, ...]]:
  """The pytree children, less the optional fields that are ``None``."""
  names = tuple(n for n in _OPTIONAL if getattr(state, n) is not None)
  return (*state[:_REQUIRED], *(getattr(state, n) for n in names)), names


def _children(state: MultiStepsState) -> tuple[tuple[Any, ...], tuple[str, ...]]:
  """:func:`_flat`'s children with their keys (the fields' names)."""
  children, names = _flat(state)
  keys = map(jax.tree_util.GetAttrKey, (*MultiStepsState._fields[:_REQUIRED], *names))
  return tuple(zip(keys, children, strict=True)), names


def _unflat(names: tuple[str, ...], children: Any) -> MultiStepsState:
  children = tuple(children)
  optional = dict(zip(names, children[_REQUIRED:], strict=True))
  return MultiStepsState(*children[:_REQUIRED], **optional)


jax.tree_util.register_pytree_with_keys(MultiStepsState, _children, _unflat, _flat)


@dataclasses.dataclass(frozen=True)
class MultiStepsConfig:
  """The settings of a :class:`MultiSteps`, validated once (see its arguments).

  Examples:
    >>> MultiStepsConfig(every_k_schedule=4).k_at(0)
    Array(4, dtype=int32)
    >>> MultiStepsConfig(every_k_schedule=0)
    Traceback (most recent call last):
      ...
    ValueError: `every_k_schedule` must be >= 1, got 0.
  """

  every_k_schedule: EveryKSchedule
  use_grad_mean: bool = True
  should_skip_update_fn: ShouldSkipUpdateFn | None = None
  accumulator_dtype: DTypeLike | None = None
  grad_reduction: GradReduction = "mean"
  axis_name: _reduction.AxisName | None = None
  on_nonfinite: NonFinitePolicy = "skip_window"
  terms: tuple[str, ...] | None = None
  noise_scale: bool = False

  def __post_init__(self) -> None:
    k = self.every_k_schedule
    if not callable(k) and k != END_WINDOW:
      if isinstance(k, bool | np.bool_) or not isinstance(k, int | np.integer):
        raise ValueError(
          "`every_k_schedule` must be an int, a callable of the update count or "
          f"'end_window' (the caller ends every window), got {k!r} "
          f"({type(k).__name__})."
        )
      if k < 1:
        raise ValueError(f"`every_k_schedule` must be >= 1, got {k}.")
    _checks.one_of(self.grad_reduction, get_args(GradReduction), name="grad_reduction")
    _checks.one_of(self.on_nonfinite, get_args(NonFinitePolicy), name="on_nonfinite")
    if self.grad_reduction == "window_mean" and self.on_nonfinite != "skip_window":
      raise ValueError(
        "grad_reduction='window_mean' keeps the default on_nonfinite="
        "'skip_window': each loss was divided by a window total that counts "
        "every micro-batch, so dropping one alone would shrink the update "
        "(by the kept share of the window's items). Use grad_reduction='mean' "
        "or 'sum' with weight=n_items to drop single micro-batches."
      )
    if self.terms is not None:
      object.__setattr__(self, "terms", self._checked_terms())
    if not isinstance(self.noise_scale, bool | np.bool_):
      raise ValueError(f"`noise_scale` must be a bool, got {self.noise_scale!r}.")
    if self.noise_scale and self.terms is not None:
      raise ValueError(
        "`noise_scale=True` measures the noise of one objective's per-item "
        f"gradients; with loss terms {list(self.terms)} each term has its own "
        "items. Measure a run without `terms`."
      )
    if not isinstance(self.use_grad_mean, bool | np.bool_):
      raise ValueError(f"`use_grad_mean` must be a bool, got {self.use_grad_mean!r}.")
    if (dtype := self.accumulator_dtype) is not None:
      if not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(
          f"`accumulator_dtype` must be a floating-point dtype, got {jnp.dtype(dtype)}."
        )
      object.__setattr__(self, "accumulator_dtype", jnp.dtype(dtype))  # Frozen: once.

  def _checked_terms(self) -> tuple[str, ...]:
    names = (self.terms,) if isinstance(self.terms, str) else tuple(self.terms or ())
    if not names or not all(isinstance(n, str) for n in names):
      raise ValueError(f"`terms` must be a tuple of names (str), got {self.terms!r}.")
    if len(set(names)) != len(names):
      raise ValueError(f"`terms` must not repeat a name, got {names!r}.")
    if self.grad_reduction != "mean" or not self.use_grad_mean:
      raise ValueError(
        "`terms` divides each term by its own weight: it needs the default "
        "grad_reduction='mean' and use_grad_mean=True, got "
        f"grad_reduction={self.grad_reduction!r}, use_grad_mean={self.use_grad_mean!r}."
      )
    return names

  def k_at(self, update_count: ArrayLike) -> jax.Array:
    """Micro-batches per window after ``update_count`` updates (int32, >= 1)."""
    k_of = self.every_k_schedule
    k = k_of(jnp.asarray(update_count)) if callable(k_of) else self.constant_k
    return jnp.maximum(jnp.asarray(k).astype(jnp.int32), 1)

  @property
  def constant_k(self) -> int | None:
    """The window length when it is the same for every window, else ``None``.
    Under ``"end_window"`` it is the int32 maximum: no count ends a window."""
    k = self.every_k_schedule
    return _NEVER if k == END_WINDOW else None if callable(k) else int(k)

  @property
  def counts_every_micro_batch(self) -> bool:
    """Whether every micro-batch counts towards ``k`` (nothing can reject one)."""
    return self.should_skip_update_fn is None

  @property
  def divides(self) -> bool:
    """Whether the window's sum is divided by its weight (a window_mean sum is
    the mean already)."""
    return bool(self.use_grad_mean) and self.grad_reduction != "window_mean"


def check_single_accumulation(inner_state: Any) -> None:
  """Raises ``ValueError`` where ``inner_state`` holds a ``MultiSteps`` state."""
  if _hyperparams.find_states(inner_state, (MultiStepsState, optax.MultiStepsState)):
    raise ValueError(
      "The optimizer already accumulates (a MultiSteps inside it): its windows "
      "would be windows of windows, and the update count wrong. Pass the "
      "accumulator itself, one optax_accum.MultiSteps, to make_train_step."
    )


def check_not_holding(state: Any, where: str) -> None:
  """``ValueError`` where ``state`` holds a streamed coupled window's micro-batches."""
  if isinstance(state, MultiStepsState) and state.held is not None:
    raise ValueError(
      f"`opt_state` holds {len(state.held)} micro-batches of a streamed CoupledLoss "
      f"window (its `held` field), which {where} cannot run: only a streaming "
      "step on that CoupledLoss ends the window. Pass the state back to it, "
      "or give this call a state from before or after that window."
    )

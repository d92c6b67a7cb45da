"""The loops ``audit`` builds: the usual loop around each accumulator, and the probe.

The probe is the caller's own optimizer with its updates replaced by the
gradient: its state advances exactly as the optimizer's would (a loop may read
``.hyperparams`` or a count from it), and params move by exactly the gradient
the loop applies, whatever the learning rate. The loops the audit builds read
no optimizer state, so theirs keeps none and its programs are shared.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import optax

from optax_accum._core._multi_steps import MultiSteps
from optax_accum._step import make_train_step

Loop = tuple[Callable, Callable]


@dataclasses.dataclass(frozen=True)
class LossView:
  """``loss_fn`` seen as ``(params, batch) -> (token-mean loss, weight)``.

  Hashable by its fields, so each ``loss_fn`` compiles once for every audit.

  Attributes:
    loss_fn: The caller's loss.
    has_aux: Whether it returns ``(loss, (weight, aux))``.
    summed: Whether it returns the loss summed over tokens (the
      ``grad_reduction="sum"`` recipe), divided here by the weight.
    terms: The names of its loss terms, where it returns ``{name: (value,
      weight)}`` (or that dict and the aux): seen as the terms' sum under the
      first term's weight, as a loop that sums them before accumulating does.
  """

  loss_fn: Callable[..., Any]
  has_aux: bool
  summed: bool = False
  terms: tuple[str, ...] = ()

  def __call__(self, params: Any, batch: Any) -> tuple[Any, Any]:
    if self.terms:  # The terms' sum, under the first term's weight.
      values, weights = self.split(params, batch)
      return sum(values[1:], values[0]), weights[0]
    value, rest = self.loss_fn(params, batch)
    weight = rest[0] if self.has_aux else rest
    return (value / weight if self.summed else value), weight

  def split(self, params: Any, batch: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Each term's value and weight, in ``terms``' order (with ``terms``)."""
    out = self.loss_fn(params, batch)
    by_name = out[0] if self.has_aux else out
    return (
      tuple(by_name[n][0] for n in self.terms),
      tuple(by_name[n][1] for n in self.terms),
    )


#: Loops and probes built by the audit, newest last: auditing the same loss and
#: optimizer again (or the restart the audit simulates) reuses their programs.
_BUILT: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
_MAX_BUILT = 16


def built_once(key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
  """``build()``, or what it returned for ``key`` before.

  Only for what keeps nothing on the host: building it again gives the same
  functions, so reusing them spares compiling them again.
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


def probe_optimizer(
  optimizer: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """``optimizer``'s state and init, with ``-grads`` as its updates.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.5)
    >>> probe = probe_optimizer(adam)
    >>> updates, state = probe.update(jnp.array([2.0]), probe.init(jnp.zeros(1)))
    >>> updates, int(state.count), float(state.hyperparams["learning_rate"])
    (Array([-2.], dtype=float32), 1, 0.5)
  """

  def build() -> optax.GradientTransformationExtraArgs:
    inner = optax.with_extra_args_support(optimizer)

    def update(
      updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
      _, state = inner.update(updates, state, params, **extra_args)
      return _negated(updates, state)

    return optax.GradientTransformationExtraArgs(inner.init, update)

  return built_once(("probe", optimizer), build)


def _negated(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
  del params
  return jax.tree.map(lambda g: -g, updates), state


#: The probe of the loops the audit builds, which read no optimizer state: it
#: keeps none, so every audit of the same loss shares its programs.
STATELESS_PROBE = optax.GradientTransformation(
  lambda params: optax.EmptyState(), _negated
)


def train_step_loop(
  loss_fn: Callable[..., Any], has_aux: bool, acc: MultiSteps
) -> Loop:
  """:func:`optax_accum.make_train_step` around ``acc``, on ``loss_fn`` as given."""
  train_step = make_train_step(loss_fn, acc, has_aux=has_aux)

  def step(params: Any, state: Any, micro_batch: Any) -> tuple[Any, Any]:
    params, state, _ = train_step(params, state, micro_batch)
    return params, state

  return acc.init, step


def usual_loop(
  loss: LossView, tx: optax.GradientTransformation, *, weighted: bool
) -> Loop:
  """The loop optax users write: each micro-batch's mean-loss gradient to
  ``tx.update`` (with ``weight=`` its tokens if ``weighted``; with loss terms,
  dicts of each term's gradient and weight), then ``optax.apply_updates``."""
  tx = optax.with_extra_args_support(tx)

  @jax.jit
  def step(params: Any, state: Any, micro_batch: Any) -> tuple[Any, Any]:
    if weighted and loss.terms:  # Dicts by term name, as MultiSteps(terms=) takes.
      grads, weight = (
        dict(zip(loss.terms, x, strict=True))
        for x in term_gradients(loss, params, micro_batch)
      )
    else:
      grads, weight = jax.grad(loss, has_aux=True)(params, micro_batch)
    extra = {"weight": weight} if weighted else {}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def term_gradients(
  loss: LossView, params: Any, batch: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """Each loss term's gradient and weight, in ``loss.terms``' order: each
  gradient from its term alone (one pullback of all terms would carry one
  term's NaN into the others as 0 * NaN), the shared forward pass computed
  once by XLA."""

  def term(i: int) -> Callable[[Any], tuple[Any, Any]]:
    def value(p: Any) -> tuple[Any, Any]:
      values, weights = loss.split(p, batch)
      return values[i], weights

    return value

  grads, weights = [], ()
  for i in range(len(loss.terms)):
    grad, weights = jax.grad(term(i), has_aux=True)(params)
    grads.append(grad)
  return tuple(grads), weights

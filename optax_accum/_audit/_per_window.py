"""A trainer that takes a whole window at a time, as ``audit`` feeds micro-batches."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optax

WindowSetup = Callable[[optax.GradientTransformation, int], tuple[Callable, Callable]]


class Buffered(NamedTuple):
  """A window trainer's state and the micro-batches of its open window."""

  state: Any
  micro_batches: tuple[Any, ...] = ()


def per_window(setup: WindowSetup) -> Callable[..., tuple[Callable, Callable]]:
  """A window-level trainer as ``audit``'s ``accumulation``.

  ``setup(optimizer, k) -> (init, train_window)`` builds your trainer around
  ``optimizer``: ``init(params) -> state`` and ``train_window(params, state,
  micro_batches) -> (params, state)``, called with a window's ``k``
  micro-batches (a list) in the order ``audit``'s ``split`` gives them: by
  default strided, micro-batch ``i`` holding rows ``i, i + k, i + 2k, ...``
  (:func:`optax_accum.split_micro_batches`). A trainer that slices contiguous
  rows itself is audited with a ``split`` that does the same, so that the
  micro-batches the audit weighs are its own. The returned ``accumulation``
  keeps each window's micro-batches in the state until the ``k``-th arrives,
  then calls
  ``train_window``; the audit's restart, one micro-step into a window, resumes
  with the micro-batch already taken.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] * params) ** 2), batch["x"].shape[0]
    >>> def my_trainer(optimizer, k):
    ...   def train_window(params, state, micro_batches):
    ...     grad = jax.grad(loss_fn, has_aux=True)
    ...     grads = [grad(params, b)[0] for b in micro_batches]
    ...     updates, state = optimizer.update(sum(grads) / k, state, params)
    ...     return optax.apply_updates(params, updates), state
    ...   return optimizer.init, train_window
    >>> report = optax_accum.audit(loss_fn, optax.sgd(0.1), jnp.ones(()),
    ...     {"x": jnp.ones(8)}, k=2, accumulation=optax_accum.per_window(my_trainer))
    >>> report.ok
    True
  """

  def accumulation(optimizer: optax.GradientTransformation, k: int):
    init, train_window = setup(optimizer, k)

    def step(params: Any, buffered: Buffered, micro_batch: Any) -> tuple[Any, Buffered]:
      micro_batches = (*buffered.micro_batches, micro_batch)
      if len(micro_batches) < k:
        return params, buffered._replace(micro_batches=micro_batches)
      params, state = train_window(params, buffered.state, list(micro_batches))
      return params, Buffered(state)

    return lambda params: Buffered(init(params)), step

  return functools.wraps(setup)(accumulation)

"""The arguments of ``plan_micro_batches`` as shape-only stand-ins, checked."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from optax_accum._core._checks import whole_number
from optax_accum._core._multi_steps import MultiSteps, MultiStepsState


def optimizer_factory(optimizer: Any) -> Callable[[int], MultiSteps]:
  """``k -> MultiSteps`` from an optax optimizer or such a function."""
  if isinstance(optimizer, MultiSteps):
    raise ValueError(
      "`optimizer` must be the inner optax optimizer (the plan chooses k), or a "
      "function k -> optax_accum.MultiSteps(opt, k, ...) for other MultiSteps "
      "options; got a MultiSteps."
    )
  if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
    return lambda k: MultiSteps(optimizer, every_k_schedule=k)
  if callable(optimizer):

    def make(k: int) -> MultiSteps:
      built = optimizer(k)
      if not isinstance(built, MultiSteps):
        raise ValueError(
          f"`optimizer({k})` must return an optax_accum.MultiSteps, got "
          f"{type(built).__name__}."
        )
      return built

    return make
  raise ValueError(
    "`optimizer` must be an optax.GradientTransformation or a function k -> "
    f"MultiSteps, got {type(optimizer).__name__}."
  )


def global_batch_rows(global_batch: Any, leaves: list[tuple[Any, Any]]) -> int:
  """``global_batch`` checked; by default the batch's leading size."""
  if global_batch is None:
    global_batch = int(np.shape(leaves[0][1])[0])
  if (
    isinstance(global_batch, int | np.integer)
    and not isinstance(global_batch, bool)
    and global_batch < 1
  ):
    raise ValueError(
      f"`global_batch` must be >= 1 row, got {int(global_batch)}: there is "
      "nothing to train on."
    )
  return whole_number(global_batch, name="global_batch")


def struct(x: Any) -> jax.ShapeDtypeStruct:
  """A shape-only stand-in for ``x`` that keeps where ``x`` is placed."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  sharding = None
  if isinstance(x, jax.Array) and getattr(x, "committed", True):
    sharding = x.sharding
  dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)  # Keys too.
  return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


def param_structs(params: Any) -> Any:
  """``params`` as structs; a ``ValueError`` when it holds no arrays."""
  params = jax.tree.map(struct, params)
  if not jax.tree.leaves(params):
    raise ValueError("`params` has no arrays.")
  return params


def data_shards(rows_like: list[tuple[Any, jax.ShapeDtypeStruct]], rows: int) -> int:
  """Data-parallel shards of the batch's rows, which ``rows`` must be a multiple of."""
  shards = math.lcm(*(_row_shards(path, s) for path, s in rows_like))
  if rows % shards:
    raise ValueError(
      f"`global_batch` {rows} must be a multiple of the {shards} "
      "data-parallel shards of the batch's leading axis."
    )
  return shards


def _row_shards(path: Any, leaf: jax.ShapeDtypeStruct) -> int:
  """How many ways the leading axis is split over devices."""
  sharding = leaf.sharding
  if sharding is None:
    return 1
  if isinstance(sharding, NamedSharding):
    spec = (*sharding.spec, None)
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return math.prod(sharding.mesh.shape[name] for name in names if name is not None)
  if len(sharding.device_set) == 1:
    return 1
  raise ValueError(
    f"`batch` leaf {jax.tree_util.keystr(path)} has a {type(sharding).__name__}: "
    "planning needs a NamedSharding (or one device) to resize its rows."
  )


def opt_state_structs(opt_state: Any, optimizer: MultiSteps, params: Any) -> Any:
  """The given ``MultiSteps`` state as structs, or the one a train step's
  ``step.init(params)`` would build on one device."""
  if opt_state is None:
    state = jax.eval_shape(optimizer.init, params)
    return _sharded_like_params(state, params)
  opt_state = jax.tree.map(struct, opt_state)
  if not isinstance(opt_state, MultiStepsState):
    raise ValueError(
      "`opt_state` must be a MultiStepsState (from the MultiSteps init), got "
      f"{type(opt_state).__name__}."
    )
  return opt_state


def _sharded_like_params(state: Any, params: Any) -> Any:
  """``state`` structs, each sharded like the param whose path and shape it shares.

  An eager ``init`` builds such leaves with ``zeros_like(param)``, which keeps
  the param's sharding; every other leaf (a counter) gets the default placement.
  """
  named = [
    (tuple(path), leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    if leaf.sharding is not None
  ]
  if not named:
    return state

  def place(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    path, best, sharding = tuple(path), -1, None
    for param_path, param in named:
      n = len(param_path)
      if n > best and param.shape == leaf.shape and path[len(path) - n :] == param_path:
        best, sharding = n, param.sharding
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(place, state)

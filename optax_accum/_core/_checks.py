"""Trace-time validation of user input, with errors that name the culprit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def check_tree_matches(tree: Any, reference: Any, *, name: str, ref_name: str) -> None:
  """Raises ``ValueError`` naming the first leaf where two trees disagree."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  ref_leaves, ref_treedef = jax.tree_util.tree_flatten_with_path(reference)
  if treedef != ref_treedef:  # type: ignore[operator]  # jaxlib stub gap
    paths = [jax.tree_util.keystr(p) for p, _ in leaves]
    ref_paths = [jax.tree_util.keystr(p) for p, _ in ref_leaves]
    if missing := [p for p in ref_paths if p not in paths]:
      raise ValueError(f"`{name}` is missing leaf {missing[0]} present in {ref_name}.")
    if extra := [p for p in paths if p not in ref_paths]:
      raise ValueError(f"`{name}` has leaf {extra[0]} that {ref_name} does not have.")
    raise ValueError(  # Same leaf paths, other node types (tuple vs list).
      f"`{name}` has the leaves of {ref_name} but another tree structure: "
      f"{treedef} vs {ref_treedef}."
    )
  for (key_path, leaf), (_, ref_leaf) in zip(leaves, ref_leaves, strict=True):
    if np.shape(leaf) != np.shape(ref_leaf):
      raise ValueError(
        f"`{name}` leaf {jax.tree_util.keystr(key_path)} has shape "
        f"{np.shape(leaf)} but {ref_name} has shape {np.shape(ref_leaf)}."
      )


def scalar(value: ArrayLike, *, name: str, dtype: Any) -> jax.Array:
  """Returns ``value`` as a scalar array of ``dtype``, or raises ``ValueError``.

  Booleans convert to ``dtype`` only when ``dtype`` is boolean, numbers only
  when it is numeric, so a mask passed where a count belongs is caught.
  """
  check_scalar(value, name=name, dtype=dtype)
  return jnp.asarray(value).astype(dtype)


def check_scalar(value: ArrayLike, *, name: str, dtype: Any) -> None:
  """Raises the ``ValueError`` of :func:`scalar`, or nothing; stages no op."""
  src = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
  want = jnp.bool_ if jnp.issubdtype(dtype, jnp.bool_) else jnp.number
  if not jnp.issubdtype(src, want) or jnp.issubdtype(src, jnp.complexfloating):
    kind = "a boolean" if want is jnp.bool_ else "a real number"
    raise ValueError(f"`{name}` must be {kind}, got dtype {src}.")
  if np.shape(value) != ():
    raise ValueError(f"`{name}` must be a scalar, got shape {np.shape(value)}.")


def whole_number(value: Any, *, name: str, minimum: int = 1) -> int:
  """``value`` as an ``int`` if it is a whole number >= ``minimum`` (no bool).

  Examples:
    >>> whole_number(np.int64(3), name='k')
    3
    >>> whole_number(True, name='k')
    Traceback (most recent call last):
      ...
    ValueError: `k` must be an int >= 1, got True.
  """
  whole = isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
  if not whole or value < minimum:
    raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
  return int(value)


def one_of(value: Any, choices: tuple[str, ...], *, name: str) -> Any:
  """``value`` if it is one of ``choices``, else a ``ValueError`` listing them."""
  if value not in choices:
    *rest, last = map(repr, choices)
    listed = f"{', '.join(rest)} or {last}" if rest else last
    raise ValueError(f"`{name}` must be {listed}, got {value!r}.")
  return value


def callable_arg(value: Any, *, name: str) -> Any:
  """``value`` if it is callable, else a ``ValueError`` naming its type."""
  if not callable(value):
    raise ValueError(f"`{name}` must be callable, got {type(value).__name__}.")
  return value


def axes(axis_name: str | tuple[str, ...] | None) -> tuple[str, ...]:
  """A mesh axis name, or a tuple of them, or ``None``, as a tuple of names.

  Examples:
    >>> axes('data'), axes(('data', 'fsdp')), axes(None)
    (('data',), ('data', 'fsdp'), ())
  """
  if axis_name is None:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_trainable_leaves(tree: Any, *, name: str) -> None:
  """Raises ``ValueError`` naming the first leaf that is not floating point.

  For a tree holding PRNG keys (a Flax NNX model with ``nnx.Dropout``), the
  error also names the key and points to the NNX dropout recipe.
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  keys = [path for path, leaf in leaves if _is_prng_key(leaf)]
  for path, leaf in leaves:
    dtype = leaf.dtype if keys and hasattr(leaf, "dtype") else jnp.result_type(leaf)
    if jnp.issubdtype(dtype, jnp.inexact):
      continue
    if keys:
      raise ValueError(
        f"`{name}` leaf {jax.tree_util.keystr(path)} has dtype {dtype}: `{name}` holds "
        f"RNG state (a PRNG key at {jax.tree_util.keystr(keys[0])}), such as a Flax "
        "NNX model's nnx.Dropout or nnx.Rngs key and counter, which cannot be trained. "
        "Pass only the params, `graphdef, params, rest = nnx.split(model, nnx.Param, "
        "...)`, and merge `rest` back inside `loss_fn`, reseeded with the key the step "
        'gives it: see "Flax NNX with dropout" in docs/recipes.md.'
      )
    raise ValueError(
      f"`{name}` leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only "
      "floating-point leaves can be accumulated. Keep integer state (step "
      "counters, indices) out of the tree you optimise, or wrap the "
      "optimizer in `optax.masked` and pass only the trainable subtree."
    )


def _is_prng_key(leaf: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def describe_output(value: Any) -> str:
  """What a user function returned, in words for an error message.

  Arrays and tracers by shape and dtype (a tracer's type name tells the user
  nothing); anything else by its type.

  Examples:
    >>> describe_output(jnp.float32(1.0)), describe_output(jnp.ones((2, 3)))
    ('a scalar (float32[])', 'an array (float32[2,3])')
    >>> describe_output(2.5), describe_output([1, 2]), describe_output(None)
    ('a scalar (Python float)', 'a list', 'None')
  """
  if value is None:
    return "None"
  if isinstance(value, bool | int | float | complex):
    return f"a scalar (Python {type(value).__name__})"
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if isinstance(shape, tuple) and dtype is not None:
    typed = f"{dtype}[{','.join(map(str, shape))}]"
    return f"a scalar ({typed})" if shape == () else f"an array ({typed})"
  return f"a {type(value).__name__}"


def batch_leaves(batch: Any) -> list[tuple[Any, Any]]:
  """``batch``'s leaves with their paths; ``ValueError`` unless it has leaves
  and all share one leading (batch) axis."""
  if not (leaves := jax.tree_util.tree_flatten_with_path(batch)[0]):
    raise ValueError("`batch` has no arrays.")
  first_path, first = leaves[0]
  for path, leaf in leaves:
    if not (shape := np.shape(leaf)):
      raise ValueError(
        f"`batch` leaf {jax.tree_util.keystr(path)} has shape (): every leaf "
        "needs a leading batch axis."
      )
    if shape[0] != np.shape(first)[0]:
      raise ValueError(
        "`batch` leaves disagree on the batch size (leading axis): "
        f"{jax.tree_util.keystr(first_path)} has {np.shape(first)[0]} rows, "
        f"{jax.tree_util.keystr(path)} has {shape[0]}. Give every leaf the same "
        "rows, so that micro-batch i takes the same rows of each."
      )
  return leaves

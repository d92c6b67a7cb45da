"""Batch helpers: micro-batches along a leading axis, and causal-LM token counts."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from optax_accum._core import _checks


def split_micro_batches(batch: Any, k: int) -> Any:
  """Regroups every leaf from ``[B, ...]`` to ``[k, B // k, ...]``.

  Micro-batch ``i`` holds rows ``i, i + k, i + 2k, ...``. Taking every k-th
  row, rather than consecutive blocks, keeps each device's rows on that device:
  a batch sharded over a ``data`` axis of ``n`` devices stays sharded along the
  second axis, with no all-gather, when every micro-batch has a multiple of
  ``n`` rows (``B // k`` divisible by ``n``). Otherwise a micro-batch cannot
  have rows on every device and JAX chooses the layout: ``B=16, k=8`` on 4
  devices comes back replicated (an all-gather), ``B=16, k=16`` sharded along
  the micro-batch axis. The values are right either way, and any split gives
  the same window gradient; pick ``k`` so that ``B // k`` is a multiple of the
  device count to keep the rows in place.

  The result is what :func:`optax_accum.make_train_step` expects in scan
  mode; ``jax.tree.map(lambda x: x[i], result)`` is micro-batch ``i`` for
  streaming.

  Args:
    batch: A tree of arrays sharing a leading batch axis.
    k: Number of micro-batches; must divide the batch size.

  Returns:
    The tree with a new leading micro-batch axis of size ``k``.

  Examples:
    >>> import numpy as np, optax_accum
    >>> optax_accum.split_micro_batches({"x": np.arange(6)}, 3)["x"]
    array([[0, 3],
           [1, 4],
           [2, 5]])
  """
  k = _checks.whole_number(k, name="k")
  for path, leaf in _checks.batch_leaves(batch):
    shape = np.shape(leaf)
    if shape[0] % k:
      raise ValueError(
        f"`batch` leaf {jax.tree_util.keystr(path)} has shape {shape}: its "
        f"leading axis must be divisible by k={k}."
      )
  return jax.tree.map(
    lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch
  )


def causal_lm_target_mask(mask: ArrayLike) -> jax.Array:
  """Which positions of a causal LM batch have a target token to predict.

  Position ``t`` predicts token ``t + 1``, so a sequence of ``n`` valid tokens
  has ``n - 1`` targets, not ``n``: counting the padding mask instead weighs
  every sequence one token too heavily (and a 1-token sequence holds nothing).

  Args:
    mask: ``[..., T]`` booleans, True where the input token is valid.

  Returns:
    ``[..., T - 1]`` booleans aligned with ``inputs = tokens[..., :-1]`` and
    ``targets = tokens[..., 1:]``: True where both ends are valid. Its sum is
    the micro-batch's ``weight``.

  Examples:
    >>> import numpy as np, optax_accum
    >>> mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    >>> optax_accum.causal_lm_target_mask(mask).sum(axis=-1)
    Array([2, 0], dtype=int32)
  """
  mask = jnp.asarray(mask)
  if mask.ndim < 1 or mask.shape[-1] < 2:
    raise ValueError(
      f"`mask` needs a time axis of length >= 2, got shape {mask.shape}."
    )
  if mask.dtype != jnp.bool_:
    raise ValueError(f"`mask` must be boolean, got dtype {mask.dtype}.")
  return mask[..., 1:] & mask[..., :-1]

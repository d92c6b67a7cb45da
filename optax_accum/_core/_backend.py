"""The backend seam: every mechanism whose best form depends on the platform.

The maths is the same on every backend; what differs is how XLA runs control
flow (:func:`once_if`, called by the programs) and what a buffer or a dispatch
costs the host (:class:`Backend`, from :func:`for_platform` and :func:`platform_of`).

Examples:
  >>> for_platform("cpu").groups_norm, for_platform("cuda").groups_norm
  (True, False)
  >>> for_platform("cpu").two_programs, for_platform("tpu").two_programs
  (True, False)
  >>> import jax.numpy as jnp
  >>> float(once_if(jnp.array(False), lambda x: x + 1, jnp.array(1.0)))
  1.0
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._core import _placement


class Backend(NamedTuple):
  """The platform-dependent choices the host makes for a train step."""

  two_programs: bool = False  # A window ends in two programs: accumulate, then end.
  # Whether the norm sums small leaves' squares a group at a time (norm_groups):
  # leaves of at most max_leaf_size elements, at most max_group_size elements
  # and max_group_leaves leaves per group.
  groups_norm: bool = False
  max_leaf_size: int = 4096
  max_group_size: int = 8192
  max_group_leaves: int = 16
  # XLA options for programs whose compile time matters more than their run
  # time (the audit's), or None.
  quick_compile: dict[str, Any] | None = None


#: ``jax_disable_most_optimizations`` for one program: XLA:CPU skips LLVM's
#: passes, compiling the same HLO in about half the time into slower code (a
#: 12-block LM's gradient: 9.6 against 17.6 CPU-s, 130 against 37 ms a call).
_NO_LLVM_PASSES = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
}
#: By platform name (``jax.Device.platform``); others get the defaults until
#: measured there. XLA:CPU runs two programs (a dispatch weighs as much as the
#: work) and sums the norm by groups (a kernel per reduction to compile):
#: docs/benchmarks.md.
_BACKENDS = {
  "cpu": Backend(two_programs=True, groups_norm=True, quick_compile=_NO_LLVM_PASSES)
}


def two_programs(config: Any, plain: bool) -> bool:
  """Whether a streamed window ends in two programs (accumulate, then the end
  alone): where the backend says so, for ``plain`` programs (no ``shard_map``,
  the step's own reduction) and where every micro-batch counts (no
  ``should_skip_update_fn`` of ``config``, a ``MultiStepsConfig``)."""
  backend = for_platform(jax.default_backend())
  return plain and config.counts_every_micro_batch and backend.two_programs


def for_platform(platform: str) -> Backend:
  """The choices for ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)."""
  return _BACKENDS.get(platform, Backend())


@contextlib.contextmanager
def overridden(platform: str, **choices: Any) -> Iterator[None]:
  """Within the block, ``platform``'s :class:`Backend` with ``choices`` changed.

  Programs already built keep the choices they were built with.

  Examples:
    >>> with overridden("cpu", groups_norm=False):
    ...   for_platform("cpu").groups_norm
    False
  """
  before = _BACKENDS.get(platform)
  _BACKENDS[platform] = for_platform(platform)._replace(**choices)
  try:
    yield
  finally:
    _BACKENDS.pop(platform, None)
    if before is not None:
      _BACKENDS[platform] = before


def platform_of(tree: Any) -> str:
  """The platform of ``tree``'s first concrete array, else JAX's default."""
  arrays = [x for x in jax.tree.leaves(tree) if _placement.concrete(x)]
  return next(iter(arrays[0].devices())).platform if arrays else jax.default_backend()


def consecutive(
  indices: list[int], shapes: Any, max_size: int, max_leaves: int | None = None
) -> list[tuple[int, ...]]:
  """``indices`` in consecutive groups of at most ``max_size`` elements, by the
  shapes ``shapes[i]``, and at most ``max_leaves`` indices (every grouping of
  leaves: the norm's, old packings).

  Examples:
    >>> consecutive([0, 1, 2], [(2,), (2,), (3,)], 4)
    [(0, 1), (2,)]
    >>> consecutive([0, 1, 2], [(2,), (2,), (3,)], 8, max_leaves=2)
    [(0, 1), (2,)]
  """
  groups: list[list[int]] = [[]]
  size = 0
  for i in indices:
    n = math.prod(shapes[i])
    full = max_leaves is not None and len(groups[-1]) >= max_leaves
    if groups[-1] and (size + n > max_size or full):
      groups.append([])
    size = size + n if groups[-1] else n  # The group's elements, with leaf i.
    groups[-1].append(i)
  return [tuple(g) for g in groups]


def norm_groups(like: Any) -> tuple[tuple[int, ...], ...]:
  """Leaves of ``like`` (the params or the updates) whose squares the window's
  norm sums in one variadic reduction: small leaves of one shape and dtype, in
  groups of at most the backend's ``max_group_size`` elements and
  ``max_group_leaves`` leaves, where the backend says so, on one device and
  outside a mesh context.

  XLA:CPU compiles a kernel per distinct reduction. A variadic reduction's
  sums differ from single ones in their last bits, so the groups depend on
  ``like`` and the backend alone, not on the state's layout: ``grad_norm`` is
  the same to the bit in every layout.

  Examples:
    On the CPU:

    >>> like = {"a": jnp.ones(3), "b": jnp.ones((2, 2)), "c": jnp.ones(3)}
    >>> norm_groups(jax.device_put(like, jax.devices("cpu")[0]))
    ((0, 2),)
  """
  backend, mesh = for_platform(platform_of(like)), jax.sharding.get_abstract_mesh()
  if not backend.groups_norm or _placement.devices(like) > 1 or not mesh.empty:
    return ()
  leaves = jax.tree.leaves(like)
  shapes = [tuple(np.shape(x)) for x in leaves]
  alike: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    if 1 <= math.prod(shapes[i]) <= backend.max_leaf_size:
      alike.setdefault((shapes[i], jnp.result_type(x)), []).append(i)
  bounds = backend.max_group_size, backend.max_group_leaves
  groups = (g for same in alike.values() for g in consecutive(same, shapes, *bounds))
  return tuple(g for g in groups if len(g) > 1)


def once_if(pred: jax.Array, fn: Callable[[Any], Any], init: Any) -> Any:
  """``fn(init)`` if ``pred`` else ``init``, ``init`` first typed like ``fn``'s
  outputs (dtype, varying axes, sharding); ``fn`` is traced once.

  On CPU and TPU a ``lax.cond``: XLA:CPU updates its operands in place
  (scratch within a few KB of a loop run once or never, no params-sized copy;
  not measured on a TPU) and compiles it no slower than the loop. XLA:GPU
  would copy a data-dependent predicate to the host and wait on every
  execution, so there ``fn`` always runs, and a select fused into its kernels
  keeps ``init`` where ``pred`` is false.

  Examples:
    >>> float(once_if(jnp.array(True), lambda x: x + 1, jnp.array(1.0)))
    2.0
  """
  fn = jax.jit(fn)  # Traced once: for its types, then for each backend's form.
  init = jax.tree.map(_placement.typed_like, init, jax.eval_shape(fn, init))

  def cond(p: jax.Array, i: Any) -> Any:
    return jax.lax.cond(p, fn, lambda x: x, i)

  def select(p: jax.Array, i: Any) -> Any:
    # lax, not jnp.where: a jnp call per leaf costs a 176-leaf model's first
    # window 0.2 CPU-s. A scalar ``p`` takes any sharding.
    return jax.tree.map(lambda new, old: jax.lax.select(p, new, old), fn(i), i)

  # One callable for CPU and TPU: platform_dependent traces each distinct one.
  return jax.lax.platform_dependent(pred, init, cpu=cond, tpu=cond, default=select)


def nan_marker(g: jax.Array) -> jax.Array:
  """Zeros where ``g`` is finite, NaN where it is not.

  Added to a sum of squares, one pass serves the finite check and the norm.
  XLA does not fold ``g - g`` to 0; with ``g * 0``, XLA:CPU writes a
  leaf-shaped array of zeros that every leaf's reduction reads.

  Examples:
    >>> nan_marker(jnp.array([1.0, jnp.inf])).tolist()
    [0.0, nan]
  """
  return g - g


#: XLA options for the programs built in :func:`compiled_with`'s block.
_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
  "compiler_options", default=None
)


@contextlib.contextmanager
def compiled_with(options: dict[str, Any] | None) -> Iterator[None]:
  """Programs built within the block compile with XLA ``options``."""
  token = _OPTIONS.set(options)
  try:
    yield
  finally:
    _OPTIONS.reset(token)


def compiler_options() -> dict[str, Any] | None:
  """The options of the enclosing :func:`compiled_with` block, if any."""
  return _OPTIONS.get()

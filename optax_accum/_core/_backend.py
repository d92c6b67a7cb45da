"""The backend seam: every mechanism whose best form depends on the platform.

Programs are the same maths on every backend; what differs is how XLA runs
their control flow (:func:`once_if`) and what a buffer or a dispatch costs the
host (:class:`Backend`). The host side asks :func:`of` with :func:`platform_of`
the params; the programs call :func:`once_if`.

Examples:
  >>> of("cpu").packs, of("cuda").packs, of("cpu").two_programs, of("tpu").two_programs
  (True, False, True, False)
  >>> import jax.numpy as jnp
  >>> float(once_if(jnp.array(False), lambda x: x + 1, jnp.array(1.0)))
  1.0
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Backend(NamedTuple):
  """The platform-dependent choices the host makes for a train step.

  Attributes:
    packs: Whether small leaves' sums share buffers.
    max_leaf_size: Leaves of at most this many elements are packed.
    min_leaves: A dtype with fewer small leaves is left as it is.
    max_group_size: A group holds at most this many elements (its leaves'
      gradients stay live until they are concatenated, and XLA:CPU compiles a
      slice kernel for each distinct offset in a group).
    two_programs: Whether the call that ends a window runs the accumulate
      program and then the window's end, rather than one program.
    quick_compile: XLA options for programs whose compile time matters more
      than their run time (the audit's), or ``None``.
  """

  packs: bool = False
  max_leaf_size: int = 4096
  min_leaves: int = 16
  max_group_size: int = 8192
  two_programs: bool = False
  quick_compile: dict[str, Any] | None = None


#: What ``jax_disable_most_optimizations`` sets, for one program: XLA:CPU
#: compiles without LLVM's optimisation passes, the same HLO in about half the
#: time and slower machine code (a 12-block LM's gradient: 9.6 against 17.6
#: CPU-s to compile, 130 against 37 ms a call).
_WITHOUT_LLVM_PASSES = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
}
#: By platform name (``jax.Device.platform``); others get ``_DEFAULT`` until
#: measured there. XLA:CPU packs (a cost per buffer, a kernel per small add) and
#: runs two programs (a dispatch weighs as much as the work): docs/benchmarks.md.
_BACKENDS = {
  "cpu": Backend(packs=True, two_programs=True, quick_compile=_WITHOUT_LLVM_PASSES)
}
_DEFAULT = Backend()


def of(platform: str) -> Backend:
  """The choices for ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)."""
  return _BACKENDS.get(platform, _DEFAULT)


@contextlib.contextmanager
def overridden(platform: str, **choices: Any) -> Iterator[None]:
  """Within the block, ``platform``'s :class:`Backend` with ``choices``
  changed (for tests and measurements: packing thresholds, say). Programs
  already built keep the choices they were built with.

  Examples:
    >>> with overridden("cpu", min_leaves=2):
    ...   of("cpu").min_leaves
    2
  """
  before = _BACKENDS.get(platform)
  _BACKENDS[platform] = of(platform)._replace(**choices)
  try:
    yield
  finally:
    if before is None:
      del _BACKENDS[platform]
    else:
      _BACKENDS[platform] = before


def platform_of(tree: Any) -> str:
  """The platform ``tree``'s arrays live on: the first committed
  ``jax.Array``'s, else JAX's default backend (abstract shapes, NumPy
  arrays, tracers)."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      return next(iter(x.devices())).platform
  return jax.default_backend()


def once_if(pred: jax.Array, fn: Callable[[Any], Any], init: Any) -> Any:
  """``fn(init)`` if ``pred`` else ``init``; ``init`` typed like ``fn``'s
  outputs, in the form for the platform the program is lowered for
  (``lax.platform_dependent``).

  On CPU and TPU a loop that runs once or never: XLA updates its carry
  (params, optimizer state) in place, where a ``cond`` or a select keeps both
  old and new values alive. XLA:GPU copies a data-dependent predicate to the
  host and waits for the device on every execution, so there ``fn`` always
  runs and a select (fused into its elementwise kernels) keeps ``init`` where
  ``pred`` is false.

  Examples:
    >>> float(once_if(jnp.array(True), lambda x: x + 1, jnp.array(1.0)))
    2.0
  """

  def looped(p: jax.Array, i: Any) -> Any:
    return jax.lax.while_loop(
      lambda carry: carry[0],
      lambda carry: (jnp.zeros_like(carry[0]), fn(carry[1])),
      (p, i),
    )[1]

  def selected(p: jax.Array, i: Any) -> Any:
    return jax.tree.map(lambda new, old: jnp.where(p, new, old), fn(i), i)

  # One callable for CPU and TPU: platform_dependent traces each distinct one.
  return jax.lax.platform_dependent(
    pred, init, cpu=looped, tpu=looped, default=selected
  )


def nan_marker(g: jax.Array) -> jax.Array:
  """Zeros where ``g`` is finite, NaN where it is not (``g - g``).

  Added to a sum of squares, one pass serves the finite check and the norm.
  XLA does not simplify ``x - x`` to 0; ``x * 0`` would do the same, but
  XLA:CPU then writes a leaf-shaped array of zeros that every leaf's
  reduction reads.

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
  """Programs built within the block compile with XLA ``options`` (the
  audit's: see :attr:`Backend.quick_compile`)."""
  token = _OPTIONS.set(options)
  try:
    yield
  finally:
    _OPTIONS.reset(token)


def compiler_options() -> dict[str, Any] | None:
  """The options of the enclosing :func:`compiled_with` block, if any."""
  return _OPTIONS.get()

"""Compiling a candidate micro-batch's programs and reading XLA's memory analysis."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum._core._multi_steps import MultiSteps, MultiStepsState
from optax_accum._step import Mode, make_train_step

ProgramName = Literal["accumulate", "update", "scan"]


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """XLA's memory analysis of one compiled program, per device, in bytes.

  ``peak_bytes = argument + output - alias + temp + resident``: everything the
  program's arguments hold, the outputs that do not reuse a donated argument's
  buffer, XLA's scratch memory, and ``resident``, buffers that stay on the
  device during the call without being its arguments (for the streaming
  accumulate-only program, the inner optimizer state).
  """

  program: ProgramName
  rows: int  # Rows per micro-batch it was compiled for (scan: of each of k).
  argument_bytes: int
  output_bytes: int
  alias_bytes: int  # Outputs written into donated argument buffers.
  temp_bytes: int
  resident_bytes: int
  compile_seconds: float  # Lowering and compiling, wall time.

  @property
  def peak_bytes(self) -> int:
    return (
      self.argument_bytes
      + self.output_bytes
      - self.alias_bytes
      + self.temp_bytes
      + self.resident_bytes
    )


@dataclasses.dataclass(frozen=True)
class PlanCandidate:
  """One micro-batch size the plan compiled, with every program a window runs."""

  mode: Mode
  micro_batch: int
  k: int  # Micro-batches per window: ceil(global_batch / micro_batch).
  last_micro_batch: int  # Real rows in a window's last micro-batch.
  programs: tuple[ProgramMemory, ...]
  budget_bytes: int
  # The train step whose programs were compiled (None once the plan let it go).
  step: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def peak_bytes(self) -> int:
    """The largest per-device peak of the programs a window runs."""
    return max(p.peak_bytes for p in self.programs)

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.budget_bytes

  @property
  def compile_seconds(self) -> float:
    return sum(p.compile_seconds for p in self.programs)


class ResidentBytes(NamedTuple):
  """Per-device bytes that stay on the device for the whole run."""

  params_bytes: int
  opt_state_bytes: int  # The inner optimizer's state.
  accumulator_bytes: int  # The accumulator and counters.

  @classmethod
  def of(cls, params: Any, opt_state: MultiStepsState) -> ResidentBytes:
    return cls(
      _argument_bytes(params),
      _argument_bytes(opt_state.inner_opt_state),
      _argument_bytes(opt_state._replace(inner_opt_state=None)),
    )

  @property
  def total(self) -> int:
    return sum(self)


@dataclasses.dataclass(frozen=True)
class CandidateSetup:
  """What every candidate's train step is built, compiled and judged with."""

  loss_fn: Callable[..., Any]
  make_optimizer: Callable[[int], MultiSteps]
  has_aux: bool
  donate: bool
  pad: bool  # Zero rows fill a window's last micro-batch.
  params: Any  # Structs, like everything below.
  opt_state: MultiStepsState
  batch_treedef: Any
  rows_like: list[tuple[Any, jax.ShapeDtypeStruct]]  # The batch's leaves.
  rng: Any
  global_batch: int
  budget_bytes: int
  resident: ResidentBytes


def compile_candidate(setup: CandidateSetup, micro: int, mode: Mode) -> PlanCandidate:
  """Compiles the programs a window of ``micro``-row micro-batches runs."""
  k = -(-setup.global_batch // micro)
  last = setup.global_batch - (k - 1) * micro
  step = make_train_step(
    setup.loss_fn,
    setup.make_optimizer(k),
    mode=mode,
    has_aux=setup.has_aux,
    donate=setup.donate,
  )
  if mode == "scan":
    programs = [_analyse(step, setup, "scan", micro, stack=k)]
  else:
    accumulate = [_analyse(step, setup, "accumulate", micro)] if k > 1 else []
    update_rows = micro if setup.pad else last
    programs = [*accumulate, _analyse(step, setup, "update", update_rows)]
    _warm(step, setup, update_rows)
  return PlanCandidate(
    mode, micro, k, last, tuple(programs), setup.budget_bytes, step=step
  )


def _analyse(
  step: Any,
  setup: CandidateSetup,
  program: ProgramName,
  rows: int,
  stack: int | None = None,
) -> ProgramMemory:
  """Compiles ``program`` for micro-batches of ``rows`` rows and measures it."""
  leaves = [_rows(s, rows, stack=stack) for _, s in setup.rows_like]
  batch = jax.tree.unflatten(setup.batch_treedef, leaves)
  started = time.perf_counter()
  lowered = step.lower(
    setup.params,
    setup.opt_state,
    batch,
    setup.rng,
    program="accumulate" if program == "accumulate" else "update",
  )
  stats = _memory_analysis(lowered)
  seconds = time.perf_counter() - started
  return ProgramMemory(
    program=program,
    rows=rows,
    argument_bytes=int(stats.argument_size_in_bytes),
    output_bytes=int(stats.output_size_in_bytes),
    alias_bytes=int(stats.alias_size_in_bytes),
    temp_bytes=int(stats.temp_size_in_bytes),
    resident_bytes=setup.resident.opt_state_bytes if program == "accumulate" else 0,
    compile_seconds=seconds,
  )


def _warm(step: Any, setup: CandidateSetup, rows: int) -> None:
  """Compiles what the call that ends a window runs where it runs two
  programs (``update`` gave their merged form): the accumulate program for
  its micro-batch's rows and the window's end, so the plan's step runs its
  windows without compiling again."""
  leaves = [_rows(s, rows) for _, s in setup.rows_like]
  batch = jax.tree.unflatten(setup.batch_treedef, leaves)
  for program in ("accumulate", "ending"):
    args = (setup.params, setup.opt_state, batch, setup.rng)
    step.lower(*args, program=program).compile()


def _rows(
  leaf: jax.ShapeDtypeStruct, rows: int, *, stack: int | None = None
) -> jax.ShapeDtypeStruct:
  """``leaf`` with ``rows`` rows, optionally stacked ``stack`` times in front."""
  shape = (rows, *leaf.shape[1:])
  sharding = leaf.sharding
  if stack is not None:
    shape = (stack, *shape)
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec))
  return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)


def _argument_bytes(tree: Any) -> int:
  """Per-device bytes of ``tree`` as XLA counts arguments (layout included)."""
  if not jax.tree.leaves(tree):
    return 0
  take = jax.jit(lambda tree: None, keep_unused=True)
  return int(_memory_analysis(take.lower(tree)).argument_size_in_bytes)


def _memory_analysis(lowered: jax.stages.Lowered) -> Any:
  stats = lowered.compile().memory_analysis()
  if stats is None:
    raise ValueError(
      f"XLA gives no memory analysis on {jax.default_backend()}: planning needs it."
    )
  return stats

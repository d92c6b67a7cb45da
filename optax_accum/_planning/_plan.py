"""``plan_micro_batches``: the largest micro-batch that fits, known before running."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import numpy as np
import optax

from optax_accum._core._checks import batch_leaves, callable_arg, one_of
from optax_accum._core._format import size
from optax_accum._core._multi_steps import MultiSteps
from optax_accum._planning._compile import (
  CandidateSetup,
  PlanCandidate,
  ResidentBytes,
  compile_candidate,
)
from optax_accum._planning._inputs import (
  data_shards,
  global_batch_rows,
  opt_state_structs,
  optimizer_factory,
  param_structs,
  struct,
)
from optax_accum._planning._micro_batch_plan import MicroBatchPlan
from optax_accum._step import Mode

OptimizerSpec: TypeAlias = optax.GradientTransformation | Callable[[int], MultiSteps]

_PROGRESS_DELAY_S = 2.0  # The progress bar appears once planning takes longer.


def plan_micro_batches(
  loss_fn: Callable[..., Any],
  optimizer: OptimizerSpec,
  params: Any,
  batch: Any,
  *,
  global_batch: int | None = None,
  memory_budget: int | None = None,
  headroom: float = 0.1,
  mode: Mode = "stream",
  pad: bool = False,
  rng: Any = None,
  has_aux: bool = False,
  donate: bool = True,
  opt_state: Any = None,
  compare_modes: bool = True,
  progress: bool = True,
) -> MicroBatchPlan:
  """Finds the largest micro-batch whose train step fits in memory, before running.

  Compiles :func:`make_train_step`'s programs ahead of time for candidate
  micro-batch sizes (shapes only: nothing is allocated or run): the whole
  batch, then a binary search below it for the largest size whose per-device
  peak fits ``memory_budget``.

  Per-device peak of one compiled program, from ``compiled.memory_analysis()``::

    peak = argument_size_in_bytes + output_size_in_bytes
           - alias_size_in_bytes + temp_size_in_bytes

  Arguments hold params, optimizer state, accumulator and micro-batch; outputs
  that reuse a donated argument's buffer (``alias_size_in_bytes``) are not
  counted twice; temporaries are XLA's scratch memory. It assumes all of them
  live at once: an upper bound on the live-range figure XLA reports as
  ``peak_memory_in_bytes`` (which on CPU leaves the temporaries out). Host
  (offloaded) memory and the compiled code are not counted. A window's peak
  is the largest of its programs':

  - ``mode="stream"``: ``max(peak(update), peak(accumulate) + opt_state)``: the
    accumulate-only program (micro-steps that cannot end a window) takes
    params and accumulator, while the inner optimizer state stays resident
    beside it; the update program takes everything. With ``k = 1`` only the
    update program runs.
  - ``mode="scan"``: ``peak(scan)``, whose arguments include the whole window
    stacked as ``[k, micro_batch, ...]``.

  Streaming counts one micro-batch on the device per call: feed micro-batches
  from the host (or count a window kept on the device in the headroom).

  Candidates: for every ``k`` from 1 to ``global_batch``, the smallest
  micro-batch that covers the global batch in ``k`` micro-batches,
  ``ceil(global_batch / k)`` (rounded up to a multiple of the batch's
  data-parallel shard count). The whole batch (``k = 1``) is compiled first,
  then a binary search runs below it, on the assumption that memory grows
  with the micro-batch once there are two or more micro-batches per window.
  When a size does not divide the global batch, a window's last micro-batch
  holds ``global_batch - (k - 1) * micro_batch`` rows:

  - streaming, ``pad=False``: the last micro-batch is that much shorter; it
    ends the window (``every_k_schedule=k``, no ``end_window`` needed) and its
    update program, compiled for the shorter shape, is part of the plan. The
    token weights make it exact for any ``loss_fn``.
  - ``pad=True`` (either mode): zero rows fill the last micro-batch up to
    ``micro_batch``. Only correct when ``loss_fn`` gives an all-zero row
    weight 0 (a zero mask).
  - scan, ``pad=False``: a scan needs ``k`` equal micro-batches, so the
    candidates are the divisors of ``global_batch``.

  Args:
    loss_fn: As for :func:`make_train_step`.
    optimizer: The inner optax optimizer (wrapped as ``MultiSteps(optimizer,
      every_k_schedule=k)``), or ``k -> MultiSteps`` for other ``MultiSteps``
      options (an accumulator dtype, ``on_nonfinite``).
    params: Arrays or ``jax.ShapeDtypeStruct`` objects; shardings are kept (a
      committed array's, or a struct's ``sharding``).
    batch: A tree of arrays or ``jax.ShapeDtypeStruct`` objects with a leading
      row axis; only each row's shape and dtype and each leaf's sharding matter.
    global_batch: Rows per optimizer update; default the batch's leading size.
    memory_budget: Bytes per device. Default: the smallest ``bytes_limit`` in
      ``device.memory_stats()`` of the devices used, less ``headroom``; a
      device that reports none (CPU) needs it given.
    headroom: Fraction of the device limit kept free for everything else the
      process holds (used only without ``memory_budget``).
    mode: ``"stream"`` or ``"scan"``, as for :func:`make_train_step`.
    pad: Pad a window's last micro-batch with zero rows (see above).
    rng: The key (or its struct) the step will be called with, if any.
    has_aux: As for :func:`make_train_step`.
    donate: As for :func:`make_train_step`.
    opt_state: The ``MultiSteps`` state (arrays or structs) to plan with. By
      default the shapes of ``plan.step.init(params)``, with each leaf
      sharded like the parameter it shadows (``acc_grads``, Adam's moments),
      as an eager ``init`` places it; give it when yours is sharded otherwise.
    compare_modes: Also compile the other mode at the chosen size.
    progress: Show a ``tqdm`` bar when planning takes more than 2 s (if tqdm
      is installed).

  Returns:
    A :class:`MicroBatchPlan`.

  Examples:
    >>> import jax.numpy as jnp, numpy as np, optax, optax_accum
    >>> def loss_fn(params, batch):
    ...   err = (batch["x"] @ params["w"] - batch["y"]) ** 2
    ...   return err.mean(), jnp.float32(batch["x"].shape[0])
    >>> params = {"w": jnp.zeros((16, 4))}
    >>> batch = {"x": np.zeros((48, 16), np.float32),
    ...          "y": np.zeros((48, 4), np.float32)}
    >>> plan = optax_accum.plan_micro_batches(
    ...   loss_fn, optax.adam(1e-3), params, batch, memory_budget=2**20)
    >>> plan.micro_batch * plan.k >= 48, plan.peak_bytes <= 2**20
    (True, True)
  """
  started = time.perf_counter()
  one_of(mode, ("stream", "scan"), name="mode")
  callable_arg(loss_fn, name="loss_fn")
  make_optimizer = optimizer_factory(optimizer)
  leaves = batch_leaves(batch)
  global_batch = global_batch_rows(global_batch, leaves)
  if not 0 <= headroom < 1:
    raise ValueError(f"`headroom` must be in [0, 1), got {headroom!r}.")
  params = param_structs(params)
  rows_like = [(path, struct(leaf)) for path, leaf in leaves]
  shards = data_shards(rows_like, global_batch)
  rng = None if rng is None else struct(rng)
  opt_state = opt_state_structs(opt_state, make_optimizer(1), params)
  resident = ResidentBytes.of(params, opt_state)
  devices = _devices(params, [s for _, s in rows_like])
  setup = CandidateSetup(
    loss_fn=loss_fn,
    make_optimizer=make_optimizer,
    has_aux=has_aux,
    donate=donate,
    pad=pad,
    params=params,
    opt_state=opt_state,
    batch_treedef=jax.tree.structure(batch),
    rows_like=rows_like,
    rng=rng,
    global_batch=global_batch,
    budget_bytes=_budget(memory_budget, headroom, devices, resident),
    resident=resident,
  )
  units = global_batch // shards
  pads = pad or mode == "stream"  # May the last micro-batch hold fewer rows?
  sizes = [shards * u for u in (_covering_sizes(units) if pads else _divisors(units))]
  return _plan(setup, sizes, mode, compare_modes, progress, started)


def _plan(
  setup: CandidateSetup,
  sizes: list[int],
  mode: Mode,
  compare_modes: bool,
  progress: bool,
  started: float,
) -> MicroBatchPlan:
  """Searches ``sizes`` (ascending) and compiles the other mode at the choice."""
  with _Progress(progress, 1 + _search_steps(len(sizes) - 1) + compare_modes) as tick:
    compiled, chosen = _search(setup, sizes, mode, tick)
    other_mode: PlanCandidate | None = None
    if compare_modes:
      other: Mode = "scan" if mode == "stream" else "stream"
      other_mode = compile_candidate(setup, chosen.micro_batch, other)
      tick(f"{other} at {chosen.micro_batch} rows")
  pad_rows = chosen.k * chosen.micro_batch - setup.global_batch if setup.pad else 0
  return MicroBatchPlan(
    mode=mode,
    global_batch=setup.global_batch,
    micro_batch=chosen.micro_batch,
    k=chosen.k,
    last_micro_batch=chosen.last_micro_batch,
    pad_rows=pad_rows,
    peak_bytes=chosen.peak_bytes,
    budget_bytes=setup.budget_bytes,
    params_bytes=setup.resident.params_bytes,
    opt_state_bytes=setup.resident.opt_state_bytes,
    accumulator_bytes=setup.resident.accumulator_bytes,
    candidates=tuple(_without_step(c, chosen) for c in compiled),
    other_mode=other_mode,
    seconds=time.perf_counter() - started,
  )


def _without_step(candidate: PlanCandidate, chosen: PlanCandidate) -> PlanCandidate:
  """``candidate`` without its train step unless it is the chosen one: the
  plan keeps one set of compiled programs alive, the ones it hands back."""
  return candidate if candidate is chosen else dataclasses.replace(candidate, step=None)


# -- budget ------------------------------------------------------------------


def _budget(
  memory_budget: Any, headroom: float, devices: list[Any], resident: ResidentBytes
) -> int:
  """Bytes per device: ``memory_budget``, or the devices' limit less ``headroom``."""
  if memory_budget is None:
    budget = _default_budget(devices, headroom)
  elif isinstance(memory_budget, bool) or not isinstance(
    memory_budget, int | np.integer
  ):
    raise ValueError(
      f"`memory_budget` must be an int number of bytes, got {memory_budget!r}."
    )
  else:
    budget = int(memory_budget)
  if budget < resident.total:
    raise ValueError(
      f"`memory_budget` {size(budget)} ({budget} bytes) per device is smaller "
      f"than params and optimizer state alone: {size(resident.total)} "
      f"({resident.total} bytes; params {resident.params_bytes}, inner optimizer "
      f"state {resident.opt_state_bytes}, accumulator and counters "
      f"{resident.accumulator_bytes})."
    )
  return budget


def _devices(params: Any, rows: list[jax.ShapeDtypeStruct]) -> list[Any]:
  devices = {
    device
    for leaf in [*jax.tree.leaves(params), *rows]
    if leaf.sharding is not None
    for device in leaf.sharding.device_set
    if device.process_index == jax.process_index()
  }
  return sorted(devices, key=lambda d: d.id) or [jax.devices()[0]]


def _default_budget(devices: list[Any], headroom: float) -> int:
  """The smallest device limit, less ``headroom``; a ValueError where unknown."""
  limits = []
  for device in devices:
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
      raise ValueError(
        f"Pass `memory_budget` (bytes per device): {device} reports no memory "
        "limit (`device.memory_stats()` has no 'bytes_limit'; CPUs never do)."
      )
    limits.append(int(stats["bytes_limit"]))
  return int(min(limits) * (1 - headroom))


# -- search ------------------------------------------------------------------


def _covering_sizes(units: int) -> list[int]:
  """``ceil(units / k)`` for every ``k`` in ``1..units``: each the smallest size
  that covers ``units`` in ``k`` parts, ascending (``O(sqrt(units))`` of them)."""
  sizes, k = [], 1
  while True:
    part = -(-units // k)
    sizes.append(part)
    if part == 1:
      return sorted(sizes)
    k = -(-units // (part - 1))  # The first k whose size is smaller.


def _divisors(units: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(units) + 1) if units % d == 0]
  return sorted({*small, *(units // d for d in small)})


def _search_steps(n: int) -> int:
  """Most compiles a binary search over ``n`` sizes needs."""
  return math.ceil(math.log2(n + 1))


def _search(
  setup: CandidateSetup, sizes: list[int], mode: Mode, tick: Callable[[str], None]
) -> tuple[list[PlanCandidate], PlanCandidate]:
  """The candidates compiled, in order, and the largest that fits."""
  compiled: list[PlanCandidate] = []

  def fits(index: int) -> bool:
    candidate = compile_candidate(setup, sizes[index], mode)
    compiled.append(candidate)
    tick(f"{candidate.micro_batch} rows: {size(candidate.peak_bytes)}")
    return candidate.fits

  # The whole batch first: one compile when it fits, and in streaming it runs
  # no accumulate-only program, so it can need less than a 2-window size.
  low, high = (
    (len(sizes) - 1, len(sizes)) if fits(len(sizes) - 1) else (-1, len(sizes) - 1)
  )
  # Invariant: sizes[:low + 1] fit, sizes[high:] do not (memory grows with size).
  while high - low > 1:
    middle = (low + high) // 2
    if fits(middle):
      low = middle
    else:
      high = middle
  if low < 0:
    raise _nothing_fits(compiled[-1], setup)
  return compiled, next(c for c in compiled if c.micro_batch == sizes[low])


def _nothing_fits(smallest: PlanCandidate, setup: CandidateSetup) -> ValueError:
  budget, resident = setup.budget_bytes, setup.resident.total
  return ValueError(
    f"No micro-batch fits `memory_budget` {size(budget)} ({budget} bytes) "
    f"per device: {smallest.micro_batch} rows need "
    f"{size(smallest.peak_bytes)} ({smallest.peak_bytes} bytes, of which "
    f"params and optimizer state {resident}).\n"
    + "\n".join(
      f"  {p.program} at {p.rows} rows: {p.peak_bytes} bytes" for p in smallest.programs
    )
  )


class _Progress:
  """``tick(label)`` after each compiled candidate; a tqdm bar only after a delay."""

  def __init__(self, enabled: bool, total: int):
    self._bar: Any = None
    if enabled:
      try:
        from tqdm import tqdm
      except ImportError:  # tqdm is optional: plan silently without it.
        return
      self._bar = tqdm(
        total=total,
        delay=_PROGRESS_DELAY_S,
        desc="planning micro-batches",
        unit="size",
        leave=False,
      )

  def __enter__(self) -> Callable[[str], None]:
    return self._tick

  def _tick(self, label: str) -> None:
    if self._bar is not None:
      self._bar.set_postfix_str(label, refresh=False)
      self._bar.update(1)

  def __exit__(self, *exc: Any) -> None:
    if self._bar is not None:
      self._bar.close()

"""``plan_micro_batches``: the largest micro-batch that fits, known before running."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum._batching import split_micro_batches
from optax_accum._multi_steps import MultiSteps, MultiStepsState
from optax_accum._train_step import Mode, make_train_step

ProgramName = Literal["accumulate", "update", "scan"]
OptimizerSpec: TypeAlias = optax.GradientTransformation | Callable[[int], MultiSteps]

_PROGRESS_DELAY_S = 2.0  # The progress bar appears once planning takes longer.


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


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
  """What :func:`plan_micro_batches` chose, and the table it chose from.

  Build the run with ``MultiSteps(opt, every_k_schedule=plan.k)`` and
  ``make_train_step(loss_fn, ..., mode=plan.mode)``; ``plan.split(batch)``
  cuts a global batch into the micro-batches the plan compiled for.
  ``print(plan)`` shows the table.
  """

  mode: Mode
  global_batch: int
  micro_batch: int
  k: int
  last_micro_batch: int  # Real rows in each window's last micro-batch.
  pad_rows: int  # Zero rows appended to the last micro-batch (pad=True).
  peak_bytes: int  # Predicted per-device peak at this size.
  budget_bytes: int
  params_bytes: int  # Per device, as XLA counts them.
  opt_state_bytes: int  # The inner optimizer's state, per device.
  accumulator_bytes: int  # The accumulator and counters, per device.
  candidates: tuple[PlanCandidate, ...]  # In the order compiled.
  other_mode: PlanCandidate | None  # The other mode at this micro-batch.
  seconds: float  # Wall time of the whole plan.

  @property
  def chosen(self) -> PlanCandidate:
    return next(c for c in self.candidates if c.micro_batch == self.micro_batch)

  @property
  def compile_seconds(self) -> float:
    return sum(c.compile_seconds for c in self.candidates)

  def split(self, batch: Any) -> Any:
    """Cuts a global batch of ``global_batch`` rows as the plan compiled it.

    Streaming: a list of ``k`` micro-batches, consecutive blocks of
    ``micro_batch`` rows; the last holds the remaining rows, or is padded with
    zero rows to ``micro_batch`` when the plan pads. NumPy leaves stay on the
    host; a jax array's blocks are placed with its sharding (the plan counts
    one micro-batch on the device at a time: a window kept on the device must
    fit in the headroom). Scan: one tree with a leading axis of ``k``
    micro-batches (:func:`split_micro_batches`, after padding).
    """
    leaves = _batch_leaves(batch)
    rows = {np.shape(leaf)[0] for _, leaf in leaves}
    if rows != {self.global_batch}:
      raise ValueError(
        f"`batch` must have the plan's {self.global_batch} rows, got leading "
        f"sizes {sorted(rows)}."
      )
    if self.pad_rows:
      batch = jax.tree.map(lambda x: _pad_rows(x, self.pad_rows), batch)
    if self.mode == "scan":
      return split_micro_batches(batch, self.k)
    return [
      jax.tree.map(
        lambda x, i=i: _placed_like(
          x[i * self.micro_batch : (i + 1) * self.micro_batch], x
        ),
        batch,
      )
      for i in range(self.k)
    ]

  def __str__(self) -> str:
    chosen = self.chosen
    last = (
      f"{self.last_micro_batch} rows + {self.pad_rows} zero rows"
      if self.pad_rows
      else f"{self.last_micro_batch} rows"
    )
    lines = [
      f"micro-batch plan ({self.mode}): {self.micro_batch} rows x k={self.k} for "
      f"a global batch of {self.global_batch} (last micro-batch: {last})",
      f"  peak {_size(self.peak_bytes)} per device, budget {_size(self.budget_bytes)}"
      f"; resident: params {_size(self.params_bytes)}, optimizer state "
      f"{_size(self.opt_state_bytes)}, accumulator {_size(self.accumulator_bytes)}",
    ]
    if self.other_mode is not None:
      other = self.other_mode
      smaller = self.mode if chosen.peak_bytes <= other.peak_bytes else other.mode
      stacked = ""
      if other.mode == "scan":
        padded = other.k * other.micro_batch != self.global_batch
        stacked = f" (stacked batch{', padded,' if padded else ''} included)"
      lines.append(
        f"  {other.mode} at {other.micro_batch} rows x k={other.k}: "
        f"{_size(other.peak_bytes)}{stacked}; {smaller} needs less"
      )
    names = [
      name
      for name in ("accumulate", "update", "scan")
      if any(p.program == name for c in self.candidates for p in c.programs)
    ]
    header = ["micro", "k", "last", *names, "peak", "fits", "compile s"]
    rows, marks = [header], [""]
    for c in sorted(self.candidates, key=lambda c: c.micro_batch):
      by_name: dict[str, str] = {p.program: _size(p.peak_bytes) for p in c.programs}
      rows.append(
        [
          str(c.micro_batch),
          str(c.k),
          str(c.last_micro_batch),
          *(by_name.get(name, "-") for name in names),
          _size(c.peak_bytes),
          "yes" if c.fits else "no",
          f"{c.compile_seconds:.2f}",
        ]
      )
      marks.append("  <- chosen" if c is chosen else "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row, mark in zip(rows, marks, strict=True):
      cells = [cell.rjust(width) for cell, width in zip(row, widths, strict=True)]
      lines.append("  " + "  ".join(cells) + mark)
    lines.append(
      f"  {len(self.candidates)} sizes compiled in {self.seconds:.1f} s "
      "(peak = arguments + outputs - donated aliases + temporaries, + the "
      "optimizer state for accumulate)"
    )
    return "\n".join(lines)


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
      default ``jax.eval_shape(optimizer.init, params)``, with each leaf
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
  if mode not in ("stream", "scan"):
    raise ValueError(f"`mode` must be 'stream' or 'scan', got {mode!r}.")
  if not callable(loss_fn):
    raise ValueError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
  make_optimizer = _optimizer_factory(optimizer)
  leaves = _batch_leaves(batch)
  if global_batch is None:
    global_batch = int(np.shape(leaves[0][1])[0])
  if isinstance(global_batch, bool) or not isinstance(global_batch, int | np.integer):
    raise ValueError(f"`global_batch` must be an int >= 1, got {global_batch!r}.")
  global_batch = int(global_batch)
  if global_batch < 1:
    raise ValueError(
      f"`global_batch` must be >= 1 row, got {global_batch}: there is nothing to "
      "train on."
    )
  if not 0 <= headroom < 1:
    raise ValueError(f"`headroom` must be in [0, 1), got {headroom!r}.")

  params = jax.tree.map(_struct, params)
  if not jax.tree.leaves(params):
    raise ValueError("`params` has no arrays.")
  rows_like = [(path, _struct(leaf)) for path, leaf in leaves]
  shards = math.lcm(*(_row_shards(path, s) for path, s in rows_like))
  if global_batch % shards:
    raise ValueError(
      f"`global_batch` {global_batch} must be a multiple of the {shards} "
      "data-parallel shards of the batch's leading axis."
    )
  rng = None if rng is None else _struct(rng)

  k_probe = make_optimizer(1)
  if opt_state is None:
    opt_state = _sharded_like_params(jax.eval_shape(k_probe.init, params), params)
  else:
    opt_state = jax.tree.map(_struct, opt_state)
    if not isinstance(opt_state, MultiStepsState):
      raise ValueError(
        "`opt_state` must be a MultiStepsState (from the MultiSteps init), got "
        f"{type(opt_state).__name__}."
      )

  params_bytes = _resident_bytes(params)
  opt_state_bytes = _resident_bytes(opt_state.inner_opt_state)
  accumulator_bytes = _resident_bytes(opt_state._replace(inner_opt_state=None))
  resident = params_bytes + opt_state_bytes + accumulator_bytes
  devices = _devices(params, [s for _, s in rows_like])
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
  if budget < resident:
    raise ValueError(
      f"`memory_budget` {_size(budget)} ({budget} bytes) per device is smaller "
      f"than params and optimizer state alone: {_size(resident)} ({resident} "
      f"bytes; params {params_bytes}, inner optimizer state {opt_state_bytes}, "
      f"accumulator and counters {accumulator_bytes})."
    )

  units = global_batch // shards
  pads = pad or mode == "stream"  # May the last micro-batch hold fewer rows?
  sizes = [shards * u for u in (_covering_sizes(units) if pads else _divisors(units))]

  def evaluate(micro: int, run_mode: Mode) -> PlanCandidate:
    k = -(-global_batch // micro)
    last = global_batch - (k - 1) * micro
    step = make_train_step(
      loss_fn, make_optimizer(k), mode=run_mode, has_aux=has_aux, donate=donate
    )
    programs: list[ProgramMemory] = []
    if run_mode == "scan":
      stacked = [(path, _rows(s, micro, stack=k)) for path, s in rows_like]
      programs.append(
        _analyse(step, "scan", micro, params, opt_state, stacked, batch, rng, 0)
      )
    else:
      if k > 1:
        programs.append(
          _analyse(
            step,
            "accumulate",
            micro,
            params,
            opt_state,
            [(path, _rows(s, micro)) for path, s in rows_like],
            batch,
            rng,
            opt_state_bytes,
          )
        )
      update_rows = micro if pad else last
      programs.append(
        _analyse(
          step,
          "update",
          update_rows,
          params,
          opt_state,
          [(path, _rows(s, update_rows)) for path, s in rows_like],
          batch,
          rng,
          0,
        )
      )
    return PlanCandidate(run_mode, micro, k, last, tuple(programs), budget)

  compiled: list[PlanCandidate] = []
  with _Progress(progress, 1 + _search_steps(len(sizes) - 1) + compare_modes) as tick:

    def fits(index: int) -> bool:
      candidate = evaluate(sizes[index], mode)
      compiled.append(candidate)
      tick(f"{candidate.micro_batch} rows: {_size(candidate.peak_bytes)}")
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
      smallest = compiled[-1]
      raise ValueError(
        f"No micro-batch fits `memory_budget` {_size(budget)} ({budget} bytes) "
        f"per device: {smallest.micro_batch} rows need "
        f"{_size(smallest.peak_bytes)} ({smallest.peak_bytes} bytes, of which "
        f"params and optimizer state {resident}).\n"
        + "\n".join(
          f"  {p.program} at {p.rows} rows: {p.peak_bytes} bytes"
          for p in smallest.programs
        )
      )
    chosen = next(c for c in compiled if c.micro_batch == sizes[low])
    other_mode: PlanCandidate | None = None
    if compare_modes:
      other: Mode = "scan" if mode == "stream" else "stream"
      other_mode = evaluate(chosen.micro_batch, other)
      tick(f"{other} at {chosen.micro_batch} rows")

  pad_rows = chosen.k * chosen.micro_batch - global_batch if pad else 0
  return MicroBatchPlan(
    mode=mode,
    global_batch=global_batch,
    micro_batch=chosen.micro_batch,
    k=chosen.k,
    last_micro_batch=chosen.last_micro_batch,
    pad_rows=pad_rows,
    peak_bytes=chosen.peak_bytes,
    budget_bytes=budget,
    params_bytes=params_bytes,
    opt_state_bytes=opt_state_bytes,
    accumulator_bytes=accumulator_bytes,
    candidates=tuple(compiled),
    other_mode=other_mode,
    seconds=time.perf_counter() - started,
  )


# -- inputs ------------------------------------------------------------------


def _optimizer_factory(optimizer: Any) -> Callable[[int], MultiSteps]:
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


def _batch_leaves(batch: Any) -> list[tuple[Any, Any]]:
  """The batch's leaves with their paths, each checked for a leading row axis."""
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError("`batch` has no arrays.")
  sizes = set()
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
        f"`batch` leaf {jax.tree_util.keystr(path)} has shape {shape}: every "
        "leaf needs a leading row axis."
      )
    sizes.add(shape[0])
  if len(sizes) > 1:
    raise ValueError(
      f"`batch` leaves must share their leading row axis, got sizes {sorted(sizes)}."
    )
  return leaves


def _struct(x: Any) -> jax.ShapeDtypeStruct:
  """A shape-only stand-in for ``x`` that keeps where ``x`` is placed."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  sharding = None
  if isinstance(x, jax.Array) and getattr(x, "committed", True):
    sharding = x.sharding
  dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)  # Keys too.
  return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


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


def _resident_bytes(tree: Any) -> int:
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
    size = -(-units // k)
    sizes.append(size)
    if size == 1:
      return sorted(sizes)
    k = -(-units // (size - 1))  # The first k whose size is smaller.


def _divisors(units: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(units) + 1) if units % d == 0]
  return sorted({*small, *(units // d for d in small)})


def _search_steps(n: int) -> int:
  """Most compiles a binary search over ``n`` sizes needs."""
  return math.ceil(math.log2(n + 1))


def _analyse(
  step: Any,
  program: ProgramName,
  rows: int,
  params: Any,
  opt_state: MultiStepsState,
  batch_leaves: list[tuple[Any, jax.ShapeDtypeStruct]],
  batch_like: Any,
  rng: Any,
  resident_bytes: int,
) -> ProgramMemory:
  treedef = jax.tree.structure(batch_like)
  batch = jax.tree.unflatten(treedef, [leaf for _, leaf in batch_leaves])
  started = time.perf_counter()
  lowered = step.lower(
    params,
    opt_state,
    batch,
    rng,
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
    resident_bytes=resident_bytes,
    compile_seconds=seconds,
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


# -- helpers -----------------------------------------------------------------


def _pad_rows(x: Any, rows: int) -> Any:
  zeros_shape = (rows, *np.shape(x)[1:])
  if isinstance(x, jax.Array):
    padded = jnp.concatenate([x, jnp.zeros(zeros_shape, x.dtype)])
    return _placed_like(padded, x)
  return np.concatenate([np.asarray(x), np.zeros(zeros_shape, np.asarray(x).dtype)])


def _placed_like(part: Any, whole: Any) -> Any:
  """``part`` of a jax array, placed with the whole array's sharding."""
  if isinstance(whole, jax.Array) and isinstance(whole.sharding, NamedSharding):
    return jax.device_put(part, whole.sharding)
  return part


def _size(n: int) -> str:
  """Bytes for people: 512 B, 12.3 KiB, 1.50 GiB."""
  value = float(n)
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(value) < 1024 or unit == "GiB":
      break
    value /= 1024
  if unit == "B":
    return f"{n} B"
  return f"{value:.{2 if value < 10 else 1}f} {unit}"

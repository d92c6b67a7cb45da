"""Compile cost: every path to a first update beside its hand-written reference.

Run from the repository root with ``python -m benchmarks.compile`` (in ``make
bench``). Users recompile on every shape change, restart and experiment, so
the time to a program matters as much as the program's. For each model, in
one process, fresh functions each (no cache shared), CPU-seconds of the
process (XLA's compile threads included), the least of ``--repeats`` runs
(each run's own learning rate makes its programs new to the compile cache),
of:

1. ``update_in_jit``: ``optax_accum.MultiSteps.update`` in the user's
   ``jit`` (the README's quickstart), traced, lowered and compiled, against
   ``optax.MultiSteps`` in the same ``jit``;
2. ``step_in_jit``: ``make_train_step``'s step traced in the user's ``jit``,
   against ``optax.MultiSteps`` in the same ``jit``;
3. ``stream``: the streaming step's first window (``k`` calls, every compile
   included), against a hand-written accumulate call and update call (the
   same window: ``k`` adds, one update);
4. ``scan``: scan mode's first call, against a hand-written ``lax.scan``
   window (as MaxText writes one).

The in-``jit`` rows also give the compiled module's instruction count (what
``tests/test_compile_cost.py`` pins: it is deterministic). Models: residual
stacks of 44, 176 and 400 leaves of 32 x 32 and of 176 and 400 of 8 x 8
(``many_leaves``), the NNX 4-block
transformer and the benchmark LM (``lm-12x64-b8``). AdamW, ``k = 4``.
Results go to ``benchmarks/results/<machine>-compile.{json,md}``.

``--cold`` measures what a fresh process meets: each side of each row timed
right after ``jax.clear_caches()`` (every traced, lowered and compiled program
JAX holds, eager operations' included; no persistent compile cache is set),
each with a new ``TrainStep`` or hand-written ``jit`` (which hold their own
programs). Only what a fresh process pays once whatever it runs (imports, the
backend, JAX's first use of each rule) stays paid, by a warm-up on a tiny
model: a fresh process's first window measured the same within noise. The
``stream`` row is then the ``k`` calls of the first window alone on both
sides; each side's setup (``step.init(params)``, against the hand loop's
``tx.init``, zero sums and copies), also after the clear and before the
window, is under ``setup_seconds``. ``--split`` (with ``--cold``) also divides
the ``stream`` row's first window on each side into CPU-seconds of tracing,
lowering to MLIR and XLA compiling per program (from JAX's compile events, the
outermost of each), the rest (running, dispatch and the step's host code), and
the count of programs compiled. Results go to
``benchmarks/results/<machine>-compile-cold.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from benchmarks.accumulation import (
  RESULTS,
  HandStream,
  causal_lm,
  copy,
  hand_scan_window,
  many_leaves,
  optax_in_jit,
)

K = 4
#: Model name -> builder (``many_leaves`` rows: leaves of 32 x 32, or 8 x 8).
MODELS: dict[str, Callable[[], dict[str, Any]]] = {
  "leaves-44": lambda: many_leaves(44, 32, 4),
  "leaves-176": lambda: many_leaves(176, 32, 4),
  "leaves-400": lambda: many_leaves(400, 32, 4),
  "leaves-176x8": lambda: many_leaves(176, 8, 4),
  "leaves-400x8": lambda: many_leaves(400, 8, 4),
  "nnx-transformer-4": lambda: nnx_transformer(4, 64, 4, 16, 4),
  "lm-12x64-b8": lambda: causal_lm(12, 64, 4, 32, 8),
}
#: Each path and its reference, in table order.
PATHS = ("update_in_jit", "step_in_jit", "stream", "scan")


def nnx_transformer(
  blocks: int, width: int, heads: int, length: int, micro_batch: int, vocab: int = 128
) -> dict[str, Any]:
  """A Flax NNX causal transformer (attention, MLP, layer norms; blocks as
  separate modules), its params as a pure tree and a loss of them."""
  from flax import nnx  # An extra: only this model needs it.

  class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.norm1 = nnx.LayerNorm(width, rngs=rngs)
      self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
      self.norm2 = nnx.LayerNorm(width, rngs=rngs)
      self.up = nnx.Linear(width, 4 * width, rngs=rngs)
      self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
      mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
      x = x + self.attention(self.norm1(x), mask=mask)
      return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

  class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.embed = nnx.Embed(vocab, width, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
      self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x)
      return self.embed.attend(self.norm(x))

  graph, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
  rng = np.random.default_rng(0)

  def loss_fn(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    logits = nnx.merge(graph, params)(batch["inputs"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    tokens = batch["mask"].sum()
    return (nll * batch["mask"]).sum() / jnp.maximum(tokens, 1.0), tokens

  def batch(rows: int) -> dict[str, np.ndarray]:
    text = rng.integers(0, vocab, (rows, length + 1))
    mask = (rng.random((rows, length)) < 0.9).astype(np.float32)
    return {"inputs": text[:, :-1], "targets": text[:, 1:], "mask": mask}

  return {"params": params, "loss_fn": loss_fn, "batch": batch, "rows": micro_batch}


def _cpu_seconds(run: Callable[[], Any], cold: bool = False) -> tuple[float, Any]:
  """CPU-seconds of ``run()`` until its outputs are ready (``cold``: JAX's
  caches cleared first)."""
  if cold:
    jax.clear_caches()
  start = time.process_time()
  out = run()
  jax.block_until_ready(out)
  return time.process_time() - start, out


def instructions(compiled: jax.stages.Compiled) -> int:
  """The compiled module's instructions (lines defining a value)."""
  return sum(" = " in line for line in compiled.as_text().splitlines())


def _in_jit(
  fn: Callable[..., Any], *args: Any, cold: bool = False
) -> tuple[float, int]:
  """CPU-seconds to trace, lower and compile ``fn`` in a fresh ``jit``; and
  the compiled module's instruction count."""
  compile_ = lambda: jax.jit(fn).lower(*args).compile()  # noqa: E731
  seconds, compiled = _cpu_seconds(compile_, cold)
  return seconds, instructions(compiled)


def accum_update_in_jit(loss_fn: Callable[..., Any], acc: Any) -> Callable[..., Any]:
  """``optax_accum.MultiSteps.update`` in the user's ``jit``, as the README
  writes it: the gradient, the update with the micro-batch's weight."""

  def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
    (_, weight), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, state = acc.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  return step


def _beside_optax(
  model: dict[str, Any], ours: Callable[..., Any], lr: float, cold: bool = False
) -> dict[str, Any]:
  """The row of a path in the user's ``jit``: ``ours(loss_fn, params)``
  gives its function and state; the reference is ``optax.MultiSteps``."""
  params, loss_fn = model["params"], model["loss_fn"]
  batch = model["batch"](model["rows"])
  fn, state = ours(loss_fn, params)
  ms = optax.MultiSteps(optax.adamw(lr), K)
  ref = _in_jit(optax_in_jit(loss_fn, ms), params, ms.init(params), batch, cold=cold)
  return _row(_in_jit(fn, params, state, batch, cold=cold), ref)


def update_in_jit(
  model: dict[str, Any], lr: float = 1e-3, cold: bool = False
) -> dict[str, Any]:
  def ours(loss_fn: Any, params: Any) -> tuple[Any, Any]:
    acc = optax_accum.MultiSteps(optax.adamw(lr), K)
    return accum_update_in_jit(loss_fn, acc), acc.init(params)

  return _beside_optax(model, ours, lr, cold)


def step_in_jit(
  model: dict[str, Any], lr: float = 1e-3, cold: bool = False
) -> dict[str, Any]:
  def ours(loss_fn: Any, params: Any) -> tuple[Any, Any]:
    acc = optax_accum.MultiSteps(optax.adamw(lr), K)
    step = optax_accum.make_train_step(loss_fn, acc)
    return (lambda p, s, b: step(p, s, b)[:2]), step.init(params)

  return _beside_optax(model, ours, lr, cold)


def stream(
  model: dict[str, Any], lr: float = 1e-3, cold: bool = False, split: bool = False
) -> dict[str, Any]:
  params, loss_fn = model["params"], model["loss_fn"]
  batch = model["batch"](model["rows"])
  acc = optax_accum.MultiSteps(optax.adamw(lr), K)
  step = optax_accum.make_train_step(loss_fn, acc)
  if cold:
    return _cold_stream(step, params, loss_fn, lr, batch, split)

  def ours() -> Any:
    p, s = copy(params), step.init(params)
    for _ in range(K):
      p, s, _ = step(p, s, batch)
    return p

  hand = HandStream(loss_fn, optax.adamw(lr), K, params)
  return _row(_cpu_seconds(ours)[:1], _cpu_seconds(hand.loop(1, batch))[:1])


def _cold_stream(
  step: Any, params: Any, loss_fn: Any, lr: float, batch: Any, split: bool
) -> dict[str, Any]:
  """The ``stream`` row from cleared caches: each side's setup, then its
  first window's ``k`` calls (``split``: each divided by :class:`Phases`)."""
  state: dict[str, Any] = {}

  def ours_setup() -> Any:
    state["ours"] = copy(params), step.init(params)
    return state["ours"]

  def ours() -> Any:
    p, s = state.pop("ours")
    for _ in range(K):
      p, s, _ = step(p, s, batch)
    return p, s

  def hand_setup() -> Any:
    state["hand"] = HandStream(loss_fn, optax.adamw(lr), K, params)
    return state["hand"].carry

  def hand() -> Any:
    return state.pop("hand").loop(1, batch)()

  sides = {}
  for side, setup, window in (("ours", ours_setup, ours), ("hand", hand_setup, hand)):
    jax.clear_caches()
    with Phases() as phases:
      setup_seconds = _cpu_seconds(setup)[0]
      phases.reset()
      seconds = _cpu_seconds(window)[0]
    sides[side] = seconds, setup_seconds, phases.summary(seconds)
  row = _row(sides["ours"][:1], sides["hand"][:1])
  row |= {
    "setup_seconds": sides["ours"][1],
    "reference_setup_seconds": sides["hand"][1],
  }
  if split:
    row |= {"split": sides["ours"][2], "reference_split": sides["hand"][2]}
  return row


class Phases:
  """The CPU-seconds (of the process, compile threads included) of each
  program's tracing, lowering to MLIR and XLA compile in a block, from JAX's
  compile events (each starts with a scalar event, ends with a duration
  event). Time counts to the outermost event open (JAX reports top-level
  traces only; an eager operation compiled inside a trace counts to the
  trace); ``compiled`` names every program compiled."""

  EVENTS: ClassVar[dict[str, str]] = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
  }

  def __init__(self) -> None:
    self.open: list[float] = []
    self.reset()

  def reset(self) -> None:
    self.seconds: dict[str, dict[str, float]] = {}
    self.compiled: list[str] = []

  def _start(self, event: str, value: float | int, **kwargs: str | int) -> None:
    if event in self.EVENTS:
      self.open.append(time.process_time())

  def _end(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
    kind = self.EVENTS.get(event)
    if kind is None or not self.open:
      return
    start = self.open.pop()
    name = str(kwargs.get("fun_name", "?")).removeprefix("jit_")
    if name.startswith("jit(") and name.endswith(")"):  # Lowered and compiled.
      name = name[4:-1]
    if kind == "compile":
      self.compiled.append(name)
    if not self.open:  # Else nested: counted in the event around it.
      program = self.seconds.setdefault(name, {})
      program[kind] = program.get(kind, 0.0) + time.process_time() - start

  def __enter__(self) -> Phases:
    jax.monitoring.register_scalar_listener(self._start)
    jax.monitoring.register_event_duration_secs_listener(self._end)
    return self

  def __exit__(self, *exc: Any) -> None:
    jax.monitoring.unregister_scalar_listener(self._start)
    jax.monitoring.unregister_event_duration_listener(self._end)

  def summary(self, total: float) -> dict[str, Any]:
    """Each program's phases, the programs compiled and the rest of ``total``
    (running, dispatch, host code)."""
    spent = sum(sum(p.values()) for p in self.seconds.values())
    return {"programs": self.seconds, "compiled": self.compiled, "rest": total - spent}


def scan(model: dict[str, Any], lr: float = 1e-3, cold: bool = False) -> dict[str, Any]:
  params, loss_fn = model["params"], model["loss_fn"]
  window = optax_accum.split_micro_batches(model["batch"](model["rows"] * K), K)
  acc = optax_accum.MultiSteps(optax.adamw(lr), K)
  step = optax_accum.make_train_step(loss_fn, acc, mode="scan")
  ours = _cpu_seconds(lambda: step(copy(params), step.init(params), window)[0], cold)
  tx = optax.adamw(lr)
  hand = jax.jit(hand_scan_window(loss_fn, tx), donate_argnums=(0, 1))
  ref = _cpu_seconds(lambda: hand(copy(params), tx.init(params), window)[0], cold)
  return _row(ours[:1], ref[:1])


def _row(ours: tuple[Any, ...], ref: tuple[Any, ...]) -> dict[str, Any]:
  row = {"seconds": ours[0], "reference_seconds": ref[0], "ratio": ours[0] / ref[0]}
  if len(ours) > 1:
    row |= {"instructions": ours[1], "reference_instructions": ref[1]}
  return row


def measure(
  name: str, repeats: int = 1, cold: bool = False, split: bool = False
) -> dict[str, Any]:
  """Every path's row for one model: of ``repeats`` runs, the least
  CPU-seconds of each side. Each run has its own learning rate, so its
  programs are new to JAX's in-process compile cache (``cold``: each side
  also starts from cleared caches; ``split``: the stream row's phases)."""
  model = MODELS[name]()
  leaves = len(jax.tree.leaves(model["params"]))
  paths = {"update_in_jit": update_in_jit, "step_in_jit": step_in_jit}
  paths |= {"stream": stream, "scan": scan}
  row: dict[str, Any] = {"model": name, "leaves": leaves}
  for p in PATHS:
    options: dict[str, Any] = {"cold": True} if cold else {}
    if cold and split and p == "stream":
      options["split"] = True
    runs = [
      paths[p](model, 1e-3 * (1 + run / 1024), **options) for run in range(repeats)
    ]
    row[p] = _least(runs)
  return row


def _least(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """One row of several runs: each side's least seconds, and the ratio of
  those; every run's seconds under ``runs``."""
  ours = min(r["seconds"] for r in runs)
  ref = min(r["reference_seconds"] for r in runs)
  best = {**runs[0], "seconds": ours, "reference_seconds": ref, "ratio": ours / ref}
  for key in ("setup_seconds", "reference_setup_seconds"):  # --cold's stream row.
    if key in runs[0]:
      best[key] = min(r[key] for r in runs)
  if "split" in runs[0]:  # Each side's split of its least run.
    best["split"] = min(runs, key=lambda r: r["seconds"])["split"]
    best["reference_split"] = min(runs, key=lambda r: r["reference_seconds"])[
      "reference_split"
    ]
  if len(runs) > 1:
    best["runs"] = [[r["seconds"], r["reference_seconds"]] for r in runs]
  return best


def _warm_up() -> None:
  """Every path once on a tiny model: JAX's first use of each primitive and
  rule is the process's, not the first measured path's."""
  tiny = many_leaves(20, 8, 2)
  for path in (update_in_jit, step_in_jit, stream, scan):
    path(tiny)


def markdown(rows: list[dict[str, Any]]) -> str:
  head = "| model | leaves | " + " | ".join(PATHS) + " |"
  lines = [head, "|" + "---|" * (len(PATHS) + 2)]
  for row in rows:
    cells = [
      f"{row[p]['seconds']:.2f} s / {row[p]['reference_seconds']:.2f} s = "
      f"**{row[p]['ratio']:.2f}x**"
      for p in PATHS
    ]
    lines.append(f"| {row['model']} | {row['leaves']} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def split_markdown(rows: list[dict[str, Any]]) -> str:
  """``--split``'s table: the stream row's first window, each side's CPU-seconds
  by program and phase, the rest, and the programs compiled."""
  kinds = ("trace", "lower", "compile")
  lines = [
    "| model | side | program | trace | lower | compile | total |",
    "|---|---|---|---|---|---|---|",
  ]
  for row in rows:
    cell = row["stream"]
    if "split" not in cell:
      continue
    for side, key, window in (
      ("ours", "split", cell["seconds"]),
      ("hand", "reference_split", cell["reference_seconds"]),
    ):
      split, head = cell[key], f"| {row['model']} | {side} |"
      for name, phases in split["programs"].items():
        times = [phases.get(k, 0.0) for k in kinds]
        cells = " | ".join(f"{t:.2f}" for t in [*times, sum(times)])
        lines.append(f"{head} {name} | {cells} |")
      lines.append(
        f"{head} rest: running, dispatch, host code | | | | {split['rest']:.2f} |"
      )
      compiled = ", ".join(split["compiled"])
      lines.append(
        f"{head} window, {len(split['compiled'])} programs compiled ({compiled})"
        f" | | | | {window:.2f} |"
      )
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(MODELS))
  parser.add_argument(
    "--repeats", type=int, default=1, help="runs per path; the least seconds count"
  )
  parser.add_argument(
    "--cold", action="store_true", help="each side from cleared caches (see above)"
  )
  parser.add_argument(
    "--split", action="store_true", help="with --cold: the stream row's phases"
  )
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.split and not args.cold:
    parser.error("--split needs --cold")
  if args.out is None:
    args.out = f"cpu-{platform.machine()}-compile" + ("-cold" if args.cold else "")
  _warm_up()
  rows = []
  for name in args.models:
    rows.append(measure(name, args.repeats, args.cold, args.split))
    print(json.dumps(rows[-1]), flush=True)
  table = markdown(rows)
  if args.cold:
    setups = [
      f"{r['model']}: {r['stream']['setup_seconds']:.2f} s / "
      f"{r['stream']['reference_setup_seconds']:.2f} s"
      for r in rows
    ]
    table += (
      "\nFrom cleared caches (`--cold`); `stream` is the first window's calls "
      "alone; its setup (init) before it: " + "; ".join(setups) + ".\n"
    )
  if args.split:
    table += "\n" + split_markdown(rows)
  print(table)
  if args.out:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(table)
  return rows


if __name__ == "__main__":
  main()

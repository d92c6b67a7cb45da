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
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

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


def _cpu_seconds(run: Callable[[], Any]) -> tuple[float, Any]:
  start = time.process_time()
  out = run()
  jax.block_until_ready(out)
  return time.process_time() - start, out


def instructions(compiled: jax.stages.Compiled) -> int:
  """The compiled module's instructions (lines defining a value)."""
  return sum(" = " in line for line in compiled.as_text().splitlines())


def _in_jit(fn: Callable[..., Any], *args: Any) -> tuple[float, int]:
  """CPU-seconds to trace, lower and compile ``fn`` in a fresh ``jit``; and
  the compiled module's instruction count."""
  seconds, compiled = _cpu_seconds(lambda: jax.jit(fn).lower(*args).compile())
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
  model: dict[str, Any], ours: Callable[..., Any], lr: float
) -> dict[str, Any]:
  """The row of a path in the user's ``jit``: ``ours(loss_fn, params)``
  gives its function and state; the reference is ``optax.MultiSteps``."""
  params, loss_fn = model["params"], model["loss_fn"]
  batch = model["batch"](model["rows"])
  fn, state = ours(loss_fn, params)
  ms = optax.MultiSteps(optax.adamw(lr), K)
  ref = _in_jit(optax_in_jit(loss_fn, ms), params, ms.init(params), batch)
  return _row(_in_jit(fn, params, state, batch), ref)


def update_in_jit(model: dict[str, Any], lr: float = 1e-3) -> dict[str, Any]:
  def ours(loss_fn: Any, params: Any) -> tuple[Any, Any]:
    acc = optax_accum.MultiSteps(optax.adamw(lr), K)
    return accum_update_in_jit(loss_fn, acc), acc.init(params)

  return _beside_optax(model, ours, lr)


def step_in_jit(model: dict[str, Any], lr: float = 1e-3) -> dict[str, Any]:
  def ours(loss_fn: Any, params: Any) -> tuple[Any, Any]:
    acc = optax_accum.MultiSteps(optax.adamw(lr), K)
    step = optax_accum.make_train_step(loss_fn, acc)
    return (lambda p, s, b: step(p, s, b)[:2]), step.init(params)

  return _beside_optax(model, ours, lr)


def stream(model: dict[str, Any], lr: float = 1e-3) -> dict[str, Any]:
  params, loss_fn = model["params"], model["loss_fn"]
  batch = model["batch"](model["rows"])
  acc = optax_accum.MultiSteps(optax.adamw(lr), K)
  step = optax_accum.make_train_step(loss_fn, acc)

  def ours() -> Any:
    p, s = copy(params), step.init(params)
    for _ in range(K):
      p, s, _ = step(p, s, batch)
    return p

  hand = HandStream(loss_fn, optax.adamw(lr), K, params)
  return _row(_cpu_seconds(ours)[:1], _cpu_seconds(hand.loop(1, batch))[:1])


def scan(model: dict[str, Any], lr: float = 1e-3) -> dict[str, Any]:
  params, loss_fn = model["params"], model["loss_fn"]
  window = optax_accum.split_micro_batches(model["batch"](model["rows"] * K), K)
  acc = optax_accum.MultiSteps(optax.adamw(lr), K)
  step = optax_accum.make_train_step(loss_fn, acc, mode="scan")
  ours = _cpu_seconds(lambda: step(copy(params), step.init(params), window)[0])
  tx = optax.adamw(lr)
  hand = jax.jit(hand_scan_window(loss_fn, tx), donate_argnums=(0, 1))
  ref = _cpu_seconds(lambda: hand(copy(params), tx.init(params), window)[0])
  return _row(ours[:1], ref[:1])


def _row(ours: tuple[Any, ...], ref: tuple[Any, ...]) -> dict[str, Any]:
  row = {"seconds": ours[0], "reference_seconds": ref[0], "ratio": ours[0] / ref[0]}
  if len(ours) > 1:
    row |= {"instructions": ours[1], "reference_instructions": ref[1]}
  return row


def measure(name: str, repeats: int = 1) -> dict[str, Any]:
  """Every path's row for one model: of ``repeats`` runs, the least
  CPU-seconds of each side. Each run has its own learning rate, so its
  programs are new to JAX's in-process compile cache."""
  model = MODELS[name]()
  leaves = len(jax.tree.leaves(model["params"]))
  paths = {"update_in_jit": update_in_jit, "step_in_jit": step_in_jit}
  paths |= {"stream": stream, "scan": scan}
  row: dict[str, Any] = {"model": name, "leaves": leaves}
  for p in PATHS:
    runs = [paths[p](model, 1e-3 * (1 + run / 1024)) for run in range(repeats)]
    row[p] = _least(runs)
  return row


def _least(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """One row of several runs: each side's least seconds, and the ratio of
  those; every run's seconds under ``runs``."""
  ours = min(r["seconds"] for r in runs)
  ref = min(r["reference_seconds"] for r in runs)
  best = {**runs[0], "seconds": ours, "reference_seconds": ref, "ratio": ours / ref}
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


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(MODELS))
  parser.add_argument(
    "--repeats", type=int, default=1, help="runs per path; the least seconds count"
  )
  parser.add_argument("--out", default=f"cpu-{platform.machine()}-compile")
  args = parser.parse_args(argv)
  _warm_up()
  rows = []
  for name in args.models:
    rows.append(measure(name, args.repeats))
    print(json.dumps(rows[-1]), flush=True)
  table = markdown(rows)
  print(table)
  if args.out:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(table)
  return rows


if __name__ == "__main__":
  main()

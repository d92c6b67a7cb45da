"""What a coupled loss costs: the two-pass window against plain accumulation
of the same loss per micro-batch (issue 50).

The model is a CLIP-style dual encoder: an image tower (an MLP on feature
vectors) and a text tower (token embeddings, mean-pooled over the valid
tokens, then an MLP), a symmetric InfoNCE loss over the window. Both steps run
whole windows in scan mode with AdamW:

- ``two-pass``: ``make_train_step(CoupledLoss(...))``: pass 1 (forward, the
  window loss and its cotangents), then the window of vector-Jacobian products;
- ``per micro-batch``: the same InfoNCE on each micro-batch alone, the usual
  (inexact) accumulation, one forward and backward a micro-batch.

Timed as a loop runs (windows queued, one block per round), interleaved, the
median of the per-round ratios. FLOPs a window from XLA's ``cost_analysis()``
of each part (XLA counts a loop's body once, so the parts are compiled alone
and multiplied by ``k``): the two passes against plain accumulation and
against one step on the whole window, which computes the same window loss.

  python -m benchmarks.coupled [--ks 4 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

FEATURES, VOCAB, SEQ, WIDTH, DIM, DEPTH, ROWS = 256, 512, 32, 512, 128, 3, 64
OUT = pathlib.Path(__file__).parent / "results"


def init_params(seed: int = 0) -> dict[str, Any]:
  rng = np.random.default_rng(seed)

  def tower(fan_in: int) -> list[jax.Array]:
    shapes = [(fan_in, WIDTH)] + [(WIDTH, WIDTH)] * (DEPTH - 1) + [(WIDTH, DIM)]
    return [jnp.asarray(rng.normal(size=s) / s[0] ** 0.5, jnp.float32) for s in shapes]

  return {
    "image": tower(FEATURES),
    "embed": jnp.asarray(rng.normal(size=(VOCAB, WIDTH)) * 0.02, jnp.float32),
    "text": tower(WIDTH),
    "scale": jnp.float32(2.0),
  }


def make_batch(rows: int, seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  lengths = rng.integers(4, SEQ + 1, (rows, 1))
  return {
    "image": jnp.asarray(rng.normal(size=(rows, FEATURES)), jnp.float32),
    "tokens": jnp.asarray(rng.integers(0, VOCAB, (rows, SEQ))),
    "tokens_mask": jnp.asarray(np.arange(SEQ) < lengths, jnp.float32),
    "mask": jnp.ones(rows, jnp.float32),
  }


def _mlp(ws: list[jax.Array], x: jax.Array) -> jax.Array:
  for w in ws[:-1]:
    x = jax.nn.gelu(x @ w)
  x = x @ ws[-1]
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def represent(params: Any, batch: Any) -> Any:
  mask = batch["tokens_mask"][..., None]
  pooled = (params["embed"][batch["tokens"]] * mask).sum(1) / mask.sum(1)
  return {
    "image": _mlp(params["image"], batch["image"]),
    "text": _mlp(params["text"], pooled),
    "scale": jnp.broadcast_to(params["scale"], batch["mask"].shape),
  }


def info_nce(z: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
  logits = jnp.exp(z["scale"][0]) * z["image"] @ z["text"].T
  labels = jnp.arange(logits.shape[0])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  loss = (loss + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels)) / 2
  return loss.mean(), jnp.float32(loss.shape[0])


COUPLED = optax_accum.CoupledLoss(represent, info_nce)


def per_micro_batch(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
  return info_nce(represent(params, batch), batch)


def _scratch(lowered: Any) -> int:
  return lowered.compile().memory_analysis().temp_size_in_bytes


def _flops(fn: Any, *args: Any) -> float:
  return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


def window_flops(coupled: Any, params: Any, window: Any) -> dict[str, float]:
  """FLOPs of one window of ``k`` micro-batches, from XLA's analysis of its
  parts: ``two_pass`` (k forwards, the window loss and its gradient, k
  vector-Jacobian products), ``plain`` (k forward-backwards of the loss on a
  micro-batch alone) and ``whole`` (one forward-backward on the whole window)."""
  k = jax.tree.leaves(window)[0].shape[0]
  micro = jax.tree.map(lambda x: x[0], window)
  rows = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), window)
  z = jax.tree.map(
    lambda s: jnp.zeros(s.shape, s.dtype),
    jax.eval_shape(coupled.represent, params, rows),
  )
  cot = jax.eval_shape(coupled.represent, params, micro)
  cot = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), cot)

  def window_loss(z: Any) -> Any:
    return coupled.window_loss(z, rows)[0]

  def product(params: Any) -> Any:
    z = coupled.represent(params, micro)
    return sum(jax.tree.leaves(jax.tree.map(lambda c, x: jnp.sum(c * x), cot, z)))

  def alone(params: Any) -> Any:
    return coupled.whole_batch(params, micro)

  two_pass = (
    k * _flops(coupled.represent, params, micro)
    + _flops(jax.grad(window_loss), z)
    + k * _flops(jax.grad(product), params)
  )
  return {
    "two_pass": two_pass,
    "plain": k * _flops(jax.grad(alone), params),
    "whole": _flops(jax.grad(coupled.whole_batch), params, rows),
  }


def measure(k: int, rounds: int, windows: int = 4) -> dict[str, float]:
  params = init_params()
  batches = [
    optax_accum.split_micro_batches(make_batch(ROWS * k, s), k) for s in range(windows)
  ]
  two_pass = optax_accum.make_train_step(COUPLED, optax.adamw(1e-4), mode="scan")
  plain = optax_accum.make_train_step(per_micro_batch, optax.adamw(1e-4), mode="scan")
  both = _scratch(two_pass.lower(params, two_pass.init(params), batches[0]))
  base = _scratch(plain.lower(params, plain.init(params), batches[0]))
  flops = window_flops(COUPLED, params, batches[0])
  steps = {"two-pass": two_pass, "per micro-batch": plain}
  states = {
    n: (jax.tree.map(jnp.copy, params), s.init(params)) for n, s in steps.items()
  }
  times: dict[str, list[float]] = {n: [] for n in steps}
  for r in range(rounds + 1):  # Round 0 compiles.
    for name, step in steps.items():
      p, s = states[name]
      start = time.perf_counter()
      for batch in batches:
        p, s, metrics = step(p, s, batch)
      jax.block_until_ready((p, metrics))
      states[name] = (p, s)
      if r:
        times[name].append((time.perf_counter() - start) / windows)
  ratios = [
    a / b for a, b in zip(times["two-pass"], times["per micro-batch"], strict=True)
  ]
  streamed = measure_stream(k, rounds, params, batches)
  return {
    **streamed,
    "k": k,
    "two_pass_ms": 1e3 * float(np.median(times["two-pass"])),
    "plain_ms": 1e3 * float(np.median(times["per micro-batch"])),
    "time_ratio": float(np.median(ratios)),
    "flops_plain": flops["two_pass"] / flops["plain"],
    "flops_whole": flops["two_pass"] / flops["whole"],
    "temp_mb": both / 1e6,
    "plain_temp_mb": base / 1e6,
  }


def measure_stream(
  k: int, rounds: int, params: Any, batches: list[Any]
) -> dict[str, float]:
  """The streamed two-pass window: the host time of a call that holds its
  micro-batch, the window's last call until its params are ready, the whole
  window, and a device copy of one micro-batch beside them."""
  step = optax_accum.make_train_step(COUPLED, optax.adamw(1e-4), every_k_schedule=k)
  micro = [[jax.tree.map(lambda x, i=i: x[i], b) for i in range(k)] for b in batches]
  copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
  p, s = jax.tree.map(jnp.copy, params), step.init(params)
  held, ends, windows, copies = [], [], [], []
  for r in range(rounds + 1):  # Round 0 compiles.
    for window in micro:
      start = time.perf_counter()
      for mb in window[:-1]:
        p, s, _ = step(p, s, mb)
      last = time.perf_counter()
      p, s, metrics = step(p, s, window[-1])
      jax.block_until_ready((p, metrics))
      done = time.perf_counter()
      jax.block_until_ready(copy(window[0]))
      if r:
        held.append((last - start) / max(k - 1, 1))
        ends.append(done - last)
        windows.append(done - start)
        copies.append(time.perf_counter() - done)
  return {
    "stream_ms": 1e3 * float(np.median(windows)),
    "held_ms": 1e3 * float(np.median(held)),
    "end_ms": 1e3 * float(np.median(ends)),
    "copy_ms": 1e3 * float(np.median(copies)),
  }


def markdown(rows: list[dict[str, float]]) -> str:
  params = sum(x.size for x in jax.tree.leaves(init_params()))
  lines = [
    f"Dual encoder, {params / 1e6:.2f}M params, {ROWS} pairs a micro-batch, AdamW, "
    f"scan mode; {jax.devices()[0].device_kind}",
    "",
    "| k | two-pass ms/window | per micro-batch ms/window | time x "
    "| FLOPs x per micro-batch | FLOPs x whole window "
    "| scratch MB (two-pass / plain) |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['k']} | {r['two_pass_ms']:.1f} | {r['plain_ms']:.1f} | "
      f"{r['time_ratio']:.2f} | {r['flops_plain']:.2f} | {r['flops_whole']:.2f} | "
      f"{r['temp_mb']:.1f} / {r['plain_temp_mb']:.1f} |"
    )
  lines += [
    "",
    "Streaming the same windows (one call a micro-batch; the last runs the window):",
    "",
    "| k | streamed ms/window | scan ms/window | held call ms | window's last "
    "call ms | device copy of a micro-batch ms |",
    "|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['k']} | {r['stream_ms']:.1f} | {r['two_pass_ms']:.1f} | "
      f"{r['held_ms']:.3f} | {r['end_ms']:.1f} | {r['copy_ms']:.3f} |"
    )
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  parser.add_argument("--machine", default="cpu-x86_64")
  args = parser.parse_args(argv)
  rows = [measure(k, args.rounds) for k in args.ks]
  text = markdown(rows)
  print(text, end="")
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"{args.machine}-coupled.md").write_text(text)
  return rows


if __name__ == "__main__":
  main()

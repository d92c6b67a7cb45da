"""Whole batch vs ``optax.MultiSteps`` vs ``optax_accum.MultiSteps``, side by side.

Run with ``python -m optax_accum.demo``. A small next-token model trains on
variable-length, padded sequences three ways, with the same data order and the
same number of AdamW updates:

1. the whole batch per update (the reference);
2. ``optax.MultiSteps`` on per-micro-batch mean losses (the common mistake);
3. ``optax_accum.MultiSteps`` with each micro-batch's token count as ``weight``.

It prints the gradient error of the first window and how far each run's
params end from the reference.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

VOCAB, WIDTH, SEQ_LEN, BATCH = 32, 16, 24, 16


def _batch(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Sequences of a noisy counting process, half of them very short."""
  starts = rng.integers(0, VOCAB, size=(BATCH, 1))
  noise = rng.integers(0, 3, size=(BATCH, SEQ_LEN + 1))
  tokens = (starts + np.cumsum(noise, axis=1)) % VOCAB
  short = rng.random(BATCH) < 0.5
  lengths = np.where(
    short, rng.integers(1, 4, BATCH), rng.integers(12, SEQ_LEN + 1, BATCH)
  )
  mask = np.arange(SEQ_LEN)[None, :] < lengths[:, None]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _loss(params: Any, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
  """Token-mean cross-entropy over valid tokens, and their count."""
  hidden = jnp.tanh(params["embed"][batch["inputs"]])
  logits = hidden @ params["head"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = jnp.asarray(batch["mask"], nll.dtype)
  weight = mask.sum()
  return (nll * mask).sum() / weight, weight


def _train(
  opt: optax.GradientTransformation,
  batches: Sequence[dict[str, np.ndarray]],
  k: int,
  params: Any,
  update_kwargs: Callable[[jax.Array], dict[str, Any]],
) -> tuple[Any, Any]:
  """Feeds each batch as ``k`` micro-batches; returns final params, first update."""

  @jax.jit
  def step(params, state, micro_batch):
    (_, weight), grads = jax.value_and_grad(_loss, has_aux=True)(params, micro_batch)
    updates, state = opt.update(grads, state, params, **update_kwargs(weight))
    return optax.apply_updates(params, updates), state, updates

  state = opt.init(params)
  first_update = None
  for batch in batches:
    for i in range(k):
      micro_batch = {name: np.split(value, k)[i] for name, value in batch.items()}
      params, state, updates = step(params, state, micro_batch)
    if first_update is None:
      first_update = updates
  return params, first_update


def _no_weight(weight: jax.Array) -> dict[str, Any]:
  del weight
  return {}


def _token_weight(weight: jax.Array) -> dict[str, Any]:
  return {"weight": weight}


def _rel(a: Any, b: Any) -> float:
  diff = jax.tree.map(jnp.subtract, a, b)
  return float(optax.tree.norm(diff) / optax.tree.norm(b))


def main(argv: Sequence[str] | None = None) -> dict[str, tuple[float, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--steps", type=int, default=40, help="optimizer updates (default 40)"
  )
  parser.add_argument(
    "--k", type=int, default=4, help="micro-batches per update (default 4)"
  )
  parser.add_argument(
    "--seed", type=int, default=0, help="data and init seed (default 0)"
  )
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error(f"--steps must be >= 2, got {args.steps}")
  if args.k < 1 or BATCH % args.k:
    parser.error(f"--k must divide the batch of {BATCH} sequences, got {args.k}")

  rng = np.random.default_rng(args.seed)
  batches = [_batch(rng) for _ in range(args.steps)]
  key_embed, key_head = jax.random.split(jax.random.key(args.seed))
  params = {
    "embed": jax.random.normal(key_embed, (VOCAB, WIDTH)),
    "head": jax.random.normal(key_head, (WIDTH, VOCAB)) / WIDTH**0.5,
  }
  adamw = optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, 3e-2, min(5, args.steps - 1), args.steps),
    weight_decay=0.01,
  )

  runs = {  # name: (optimizer factory, micro-batches per update, extra args)
    "whole batch": (lambda opt: opt, 1, _no_weight),
    "optax.MultiSteps": (lambda opt: optax.MultiSteps(opt, args.k), args.k, _no_weight),
    "optax_accum.MultiSteps": (
      lambda opt: optax_accum.MultiSteps(opt, args.k),
      args.k,
      _token_weight,
    ),
  }
  results = {}
  print(f"{args.steps} AdamW updates, {BATCH} sequences per update, k={args.k}\n")
  print(f"{'run':<24} {'first-window grad error':>24} {'final params diff':>18}")
  for name, (wrap, k, kwargs) in runs.items():
    # optax.identity() hands back the gradient the optimizer would receive.
    _, grad = _train(wrap(optax.identity()), batches[:1], k, params, kwargs)
    final, _ = _train(wrap(adamw), batches, k, params, kwargs)
    if name == "whole batch":
      ref_grad, ref_params = grad, final
    results[name] = (_rel(grad, ref_grad), _rel(final, ref_params))
    print(f"{name:<24} {results[name][0]:>24.2e} {results[name][1]:>18.2e}")
  print("\n(relative to the whole-batch run: ||a - b|| / ||b||)")
  return results


if __name__ == "__main__":
  main()

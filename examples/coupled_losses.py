"""Two losses that couple the window, trained exactly with accumulation.

- A CLIP-style dual encoder (image and text towers, here MLPs on feature
  vectors) with a symmetric InfoNCE loss: every pair of the window is every
  other pair's negative, padding pairs none.
- A mixture-of-experts regression with the Switch balance loss over the
  window (the expert fractions ``f`` from the window's tokens) beside the
  model's own token-mean loss.

Each trains a few windows with AdamW through ``make_train_step`` on an
``optax_accum.CoupledLoss`` in scan mode, then the same number of updates on
whole batches, and the usual per-micro-batch accumulation of the same loss;
it prints how far each ends from the whole-batch run.

Run: python examples/coupled_losses.py [--windows 6] [--k 4]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

ROWS = 32


def unit(x: jax.Array) -> jax.Array:
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def mlp(params: list[jax.Array], x: jax.Array) -> jax.Array:
  for w in params[:-1]:
    x = jax.nn.gelu(x @ w)
  return x @ params[-1]


# --- CLIP: a dual encoder with symmetric InfoNCE -----------------------------------


def clip_represent(params: Any, batch: Any) -> Any:
  """Each row's unit-norm image and text embeddings, and the temperature."""
  return {
    "image": unit(mlp(params["image"], batch["image"])),
    "text": unit(mlp(params["text"], batch["text"])),
    "scale": jnp.broadcast_to(params["scale"], batch["mask"].shape),
  }


def info_nce(z: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
  """Symmetric InfoNCE over the valid pairs: (mean loss, valid pairs)."""
  mask = batch["mask"]
  logits = jnp.exp(z["scale"][0]) * z["image"] @ z["text"].T
  labels = jnp.arange(mask.shape[0])
  i2t = optax.softmax_cross_entropy_with_integer_labels(
    jnp.where(mask[None, :] > 0, logits, -1e9), labels
  )
  t2i = optax.softmax_cross_entropy_with_integer_labels(
    jnp.where(mask[:, None] > 0, logits, -1e9).T, labels
  )
  n = mask.sum()
  return ((i2t + t2i) / 2 * mask).sum() / jnp.maximum(n, 1.0), n


def clip_setup(rng: np.random.Generator) -> tuple[Any, Any, Any]:
  def tower(width: int) -> list[jax.Array]:
    shapes = [(width, 32), (32, 16)]
    return [jnp.asarray(rng.normal(size=s) / s[0] ** 0.5, jnp.float32) for s in shapes]

  params = {"image": tower(12), "text": tower(8), "scale": jnp.float32(2.0)}

  def batch() -> dict[str, jax.Array]:
    return {
      "image": jnp.asarray(rng.normal(size=(ROWS, 12)), jnp.float32),
      "text": jnp.asarray(rng.normal(size=(ROWS, 8)), jnp.float32),
      "mask": jnp.asarray(rng.random(ROWS) < 0.8, jnp.float32),  # Padding pairs.
    }

  return optax_accum.CoupledLoss(clip_represent, info_nce), params, batch


# --- A mixture of experts with the Switch balance loss ------------------------------

EXPERTS, TOKENS, WIDTH = 4, 8, 6


def router_probs(params: Any, batch: Any) -> jax.Array:
  return jax.nn.softmax(batch["x"] @ params["router"], axis=-1)


def switch_balance(probs: jax.Array, batch: Any) -> tuple[jax.Array, jax.Array]:
  """``0.01 * E * sum_i f_i P_i`` over the window's valid tokens."""
  mask = batch["mask"][..., None]
  n = batch["mask"].sum()
  top = jax.nn.one_hot(jnp.argmax(probs, axis=-1), EXPERTS, dtype=probs.dtype)
  f = jax.lax.stop_gradient((top * mask).sum((0, 1)) / n)
  p = (probs * mask).sum((0, 1)) / n
  return 0.01 * EXPERTS * (f * p).sum(), n


def moe_loss(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
  """Top-1 routing: the chosen expert's linear output, scaled by its router
  probability, against the target; the mean over valid tokens."""
  probs = router_probs(params, batch)
  pick = jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS, dtype=probs.dtype) * probs
  out = jnp.einsum("rte,ew,rtw->rt", pick, params["experts"], batch["x"])
  n = batch["mask"].sum()
  return (((out - batch["y"]) ** 2) * batch["mask"]).sum() / n, n


def moe_setup(rng: np.random.Generator) -> tuple[Any, Any, Any]:
  params = {
    "router": jnp.asarray(rng.normal(size=(WIDTH, EXPERTS)), jnp.float32),
    "experts": jnp.asarray(rng.normal(size=(EXPERTS, WIDTH)) / WIDTH, jnp.float32),
  }

  def batch() -> dict[str, jax.Array]:
    lengths = rng.integers(1, TOKENS + 1, (ROWS, 1))
    return {
      "x": jnp.asarray(rng.normal(size=(ROWS, TOKENS, WIDTH)), jnp.float32),
      "y": jnp.asarray(rng.normal(size=(ROWS, TOKENS)), jnp.float32),
      "mask": jnp.asarray(np.arange(TOKENS) < lengths, jnp.float32),
    }

  return optax_accum.CoupledLoss(router_probs, switch_balance, moe_loss), params, batch


# --- the three runs ----------------------------------------------------------------


def windowed(coupled: Any, params: Any, batches: Sequence[Any], k: int) -> Any:
  """The two-pass window: the library's step on the CoupledLoss."""
  step = optax_accum.make_train_step(coupled, optax.adamw(1e-2), mode="scan")
  params, state = jax.tree.map(jnp.copy, params), step.init(params)
  for batch in batches:
    params, state, _ = step(params, state, optax_accum.split_micro_batches(batch, k))
  return params


def whole_batches(coupled: Any, params: Any, batches: Sequence[Any]) -> Any:
  """The oracle: one AdamW update per whole batch."""
  opt = optax.adamw(1e-2)

  @jax.jit
  def update(params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
    grads = jax.grad(coupled.whole_batch)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  for batch in batches:
    params, state = update(params, state, batch)
  return params


def per_micro_batch(coupled: Any, params: Any, batches: Sequence[Any], k: int) -> Any:
  """What trainers do today: the same loss on each micro-batch alone,
  token-weighted by ``MultiSteps``."""

  def loss_fn(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    return coupled.whole_batch(params, batch), batch["mask"].sum()

  step = optax_accum.make_train_step(loss_fn, optax.adamw(1e-2), mode="scan")
  params, state = jax.tree.map(jnp.copy, params), step.init(params)
  for batch in batches:
    params, state, _ = step(params, state, optax_accum.split_micro_batches(batch, k))
  return params


def rel(a: Any, b: Any) -> float:
  diff = optax.tree.norm(jax.tree.map(jnp.subtract, a, b))
  return float(diff / optax.tree.norm(b))


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--windows", type=int, default=6)
  parser.add_argument("--k", type=int, default=4)
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  results = {}
  setups = {"CLIP, InfoNCE": clip_setup, "MoE, Switch balance": moe_setup}
  for name, setup in setups.items():
    coupled, params, make_batch = setup(rng)
    batches = [make_batch() for _ in range(args.windows)]
    whole = whole_batches(coupled, params, batches)
    results[name] = {
      "two-pass window": rel(windowed(coupled, params, batches, args.k), whole),
      "per micro-batch": rel(per_micro_batch(coupled, params, batches, args.k), whole),
    }
  print(f"{args.windows} AdamW updates, k={args.k}: ||a - b|| / ||b|| of the params")
  print("from the whole-batch run       two-pass window   per micro-batch")
  for name, r in results.items():
    print(f"{name:<30} {r['two-pass window']:>15.1e} {r['per micro-batch']:>17.1e}")
  return results


if __name__ == "__main__":
  main()

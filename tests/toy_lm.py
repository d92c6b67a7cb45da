"""A tiny language model on variable-length, padded batches, for the tests.

Sequences have random lengths from 1 to ``seq_len``; the rest is padding and
masked out. The loss is per-token cross-entropy, reduced over valid tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

VOCAB = 11
WIDTH = 8


def init_params(seed: int = 0, dtype=jnp.float32) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
    "embed": jax.random.normal(k1, (VOCAB, WIDTH), dtype),
    "head": {
      "w": (jax.random.normal(k2, (WIDTH, VOCAB), dtype) / WIDTH**0.5),
      "b": jnp.zeros((VOCAB,), dtype),
    },
  }


def make_batch(seed: int, batch: int = 28, seq_len: int = 16) -> dict[str, np.ndarray]:
  """Random tokens with lengths that vary strongly between sequences."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(batch, seq_len + 1))
  # Half the sequences are short, half long: token counts per micro-batch vary.
  lengths = np.where(
    rng.random(batch) < 0.5,
    rng.integers(1, 4, size=batch),
    rng.integers(seq_len // 2, seq_len + 1, size=batch),
  )
  mask = np.arange(seq_len)[None, :] < lengths[:, None]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def split(batch: dict[str, np.ndarray], k: int) -> list[dict[str, np.ndarray]]:
  """``k`` micro-batches, rows ``i::k``: as ``optax_accum.split_micro_batches``."""
  return [{n: v[i::k] for n, v in batch.items()} for i in range(k)]


def token_losses(params, batch, rows=None) -> tuple[jax.Array, jax.Array]:
  """Per-token cross-entropy and the float mask of valid tokens.

  ``rows``: where the embedding lookup's result goes (its ``out_sharding``):
  on an Explicit mesh with the batch split over it, JAX asks.
  """
  dtype = params["embed"].dtype
  embedded = params["embed"].at[batch["inputs"]].get(out_sharding=rows)
  hidden = jnp.tanh(embedded)
  logits = hidden @ params["head"]["w"] + params["head"]["b"][None, None, :]
  if jnp.dtype(dtype).itemsize < 4:  # bf16 params: softmax in float32.
    logits = logits.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  mask = jnp.asarray(batch["mask"]).astype(nll.dtype)
  return nll * mask, mask


def mean_loss(params, batch, rows=None) -> tuple[jax.Array, jax.Array]:
  """Token-mean loss and the number of valid tokens: ``(loss, weight)``."""
  losses, mask = token_losses(params, batch, rows)
  weight = mask.sum()
  return losses.sum() / weight, weight


def sum_loss(params, batch) -> tuple[jax.Array, jax.Array]:
  """Summed loss over valid tokens and their number: ``(loss, weight)``."""
  losses, mask = token_losses(params, batch)
  return losses.sum(), mask.sum()


def grad_and_weight(loss_fn, params, batch):
  grads, weight = jax.grad(loss_fn, has_aux=True)(params, batch)
  return grads, weight


def rel_error(a, b) -> float:
  """``||a - b|| / ||b||`` over whole trees (global 2-norm)."""
  diff = jax.tree.map(lambda x, y: x.astype(y.dtype) - y, a, b)
  return float(optax.tree.norm(diff) / optax.tree.norm(b))


def max_rel_diff(a, b) -> float:
  """Largest ``max|a - b| / max|b|`` over the leaves of two trees."""
  return max(
    float(jnp.max(jnp.abs(x.astype(y.dtype) - y)) / jnp.max(jnp.abs(y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def whole_batch_run(params, batches, opt, loss_fn=mean_loss):
  """The oracle: one update of ``opt`` per whole batch, no accumulation.

  Returns the final params and each update's loss and gradient norm.
  """

  @jax.jit
  def step(params, state, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, optax.tree.norm(grads)

  state, losses, norms = opt.init(params), [], []
  for batch in batches:
    params, state, loss, norm = step(params, state, batch)
    losses.append(float(loss))
    norms.append(float(norm))
  return params, losses, norms


def adamw_with_schedule(updates: int = 10):
  """AdamW whose warmup-cosine learning rate counts applied updates."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 3, updates, 1e-3)
  return optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax_accum.progress_schedule(schedule), weight_decay=0.1
  )


def feed_window(step, params, state, batch, k, mode, *extra):
  """One window through a `make_train_step` step: `k` calls, or one in scan mode."""
  if mode == "scan":
    return step(params, state, optax_accum.split_micro_batches(batch, k), *extra)
  for micro_batch in split(batch, k):
    params, state, metrics = step(params, state, micro_batch, *extra)
  return params, state, metrics

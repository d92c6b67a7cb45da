"""Small Flax models, token-level batches and losses for the Flax tests.

Per-token features and labels in sequences of very different lengths; the
loss is cross-entropy over the valid tokens.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

FEATURES, HIDDEN, CLASSES, K = 6, 16, 5, 4


def make_batches(updates):
  """``updates`` batches of 16 sequences; the same seed, so a prefix agrees."""
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(updates):
    x = rng.normal(size=(16, 12, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=(16, 12))
    lengths = np.where(
      rng.random(16) < 0.5, rng.integers(1, 3, 16), rng.integers(8, 13, 16)
    )
    mask = np.arange(12)[None, :] < lengths[:, None]
    batches.append({"x": x, "labels": labels, "mask": mask})
  return batches


def micro_batches(batch):
  return [jax.tree.map(lambda x, i=i: x[i::K], batch) for i in range(K)]


def summed_ce(logits, batch):
  """Cross-entropy summed over valid tokens, and their number."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
  mask = jnp.asarray(batch["mask"], ce.dtype)
  return (ce * mask).sum(), mask.sum()


def token_mean_ce(logits, batch):
  total, n = summed_ce(logits, batch)
  return total / n, n


def rel(a, b):
  """Relative distance of two trees' leaves, in order."""
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  diff = optax.tree.norm([x - y for x, y in zip(a, b, strict=True)])
  return float(diff / optax.tree.norm(b))


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(jax.nn.tanh(nn.Dense(HIDDEN)(x)))


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.tanh(self.hidden(x)))


def linen_mlp():
  """A LinenMLP, its params (seed 0) and its token-mean loss."""
  model = LinenMLP()
  params = model.init(jax.random.key(0), make_batches(1)[0]["x"])["params"]

  def loss_fn(params, batch):
    return token_mean_ce(model.apply({"params": params}, batch["x"]), batch)

  return model, params, loss_fn

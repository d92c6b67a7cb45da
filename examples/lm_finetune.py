"""Train a small causal transformer LM with gradient accumulation, end to end.

A recipe to copy: every piece a real language-model run needs, at a size that
runs on a CPU (20 to 30 s of CPU time measured on 2 cores, mostly compiling).

- The model: a causal transformer in Flax NNX (token and position embeddings,
  pre-LayerNorm blocks of multi-head self-attention and an MLP, a final
  LayerNorm and an output head).
- The data: clauses of a text, one sequence each, so lengths vary (4 to 64
  characters here); padded on the right to one length and masked.
- The loss: cross-entropy averaged over the valid target tokens, returned with
  their count, ``(loss, weight)``: the window's update is the token mean over
  every micro-batch of the window, as if the whole batch had been one.
- The optimizer: AdamW with a warmup-cosine learning rate that counts applied
  updates (``optax_accum.progress_schedule``), accumulated over ``k``
  micro-batches by ``optax_accum.MultiSteps``, run by ``make_train_step``.
- The check: the same run on whole batches, no accumulation, must end with
  the same losses and params (see "Same updates, leaf by leaf" in
  docs/multi_steps.md for why the params are compared leaf by leaf on leaves
  that have a gradient).

To fine-tune a model you already have, load its weights into ``model`` where
``main`` builds it (``nnx.update(model, restored_state)`` after an Orbax
restore, for instance), before ``nnx.split``, and point ``--text`` at your
data. The text is read as characters.

Run: python examples/lm_finetune.py [--windows 12] [--k 4] [--text FILE]
"""

from __future__ import annotations

import argparse
import importlib.resources
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum

SEQ_LEN = 64  # Tokens per sequence, padding included (inputs and targets: 63).
BATCH = 16  # Sequences per optimizer update (the window), over all k micro-batches.
WIDTH, HEADS = 64, 4


class Block(nnx.Module):
  """Pre-LN transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.mlp_in = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), mask=mask, deterministic=True)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class CausalLM(nnx.Module):
  def __init__(self, vocab: int, layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, WIDTH, rngs=rngs)
    self.position = nnx.Embed(SEQ_LEN, WIDTH, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits ``[B, T, vocab]`` for the next token at every position."""
    x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))[None]
    # Padding is on the right, so under a causal mask a real token never
    # attends to padding; what padded positions compute is masked in the loss.
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def read_sequences(text: str) -> tuple[list[np.ndarray], list[str]]:
  """One sequence of character ids per clause, at most ``SEQ_LEN`` long."""
  clauses = re.split(r"(?<=[,.;:?!])\s+", " ".join(text.split()))
  vocab = sorted(set(text))
  index = {c: i for i, c in enumerate(vocab)}
  sequences = [
    np.array([index[c] for c in clause[:SEQ_LEN]]) for clause in clauses if clause
  ]
  return sequences, vocab


def make_batch(sequences: list[np.ndarray], rng: np.random.Generator) -> dict:
  """``BATCH`` random sequences, right-padded with 0 to ``SEQ_LEN``, and their
  mask (True on real tokens)."""
  tokens = np.zeros((BATCH, SEQ_LEN), np.int32)
  mask = np.zeros((BATCH, SEQ_LEN), bool)
  for row, i in enumerate(rng.choice(len(sequences), BATCH)):
    tokens[row, : len(sequences[i])] = sequences[i]
    mask[row, : len(sequences[i])] = True
  return {"tokens": tokens, "mask": mask}


def micro_batches(batch: dict, k: int) -> list[dict]:
  """``k`` micro-batches: rows ``i, i + k, ...`` (as ``split_micro_batches``)."""
  return [{name: value[i::k] for name, value in batch.items()} for i in range(k)]


def make_loss_fn(graphdef: Any):
  def loss_fn(params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Token-mean cross-entropy over valid targets, and how many there are."""
    logits = nnx.merge(graphdef, params)(batch["tokens"][:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["tokens"][:, 1:]
    )
    # A target counts when it and the token before it are real tokens.
    targets = optax_accum.causal_lm_target_mask(batch["mask"]).astype(nll.dtype)
    n = targets.sum()
    return (nll * targets).sum() / n, n

  return loss_fn


def make_optimizer(windows: int) -> optax.GradientTransformation:
  """AdamW, warmup then cosine decay over the run's updates."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=3e-3,
    warmup_steps=max(windows // 5, 1),
    decay_steps=windows,
    end_value=3e-4,
  )
  # progress_schedule counts applied updates (not micro-steps): one value of
  # the learning rate per window, and the decay ends when the run does.
  return optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax_accum.progress_schedule(schedule), weight_decay=0.01
  )


def train(params: Any, loss_fn, batches: list[dict], k: int) -> tuple[Any, list]:
  """The run: one window of ``k`` micro-batches per batch, one update each."""
  tx = make_optimizer(len(batches))
  opt = optax_accum.MultiSteps(tx, every_k_schedule=k)
  step = optax_accum.make_train_step(loss_fn, opt)  # jitted
  # The step donates (reuses) the buffers of the params and state it is given:
  # start from a copy, so the caller's params stay usable.
  params, opt_state = jax.jit(lambda p: (jax.tree.map(jnp.copy, p), opt.init(p)))(
    params
  )
  losses = []
  for window, batch in enumerate(batches, start=1):
    for micro_batch in micro_batches(batch, k):
      params, opt_state, metrics = step(params, opt_state, micro_batch)
    assert bool(metrics["updated"])  # The k-th micro-batch ended the window.
    losses.append(float(metrics["loss"]))  # Token mean over the whole window.
    print(
      f"window {window:3d}  loss {losses[-1]:.4f}  tokens {int(metrics['weight']):4d}"
      f"  lr {float(metrics['learning_rate']):.2e}"
      f"  grad norm {float(metrics['grad_norm']):.3f}",
      flush=True,
    )
  return params, losses


def whole_batch(params: Any, loss_fn, batches: list[dict]) -> tuple[Any, list, Any]:
  """The reference: the same updates, each on the whole batch at once.
  Also returns each leaf's largest gradient norm over the run."""
  tx = make_optimizer(len(batches))

  @jax.jit
  def step(params, opt_state, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    norms = jax.tree.map(jnp.linalg.norm, grads)
    return optax.apply_updates(params, updates), opt_state, loss, norms

  opt_state, losses, grad_norms = tx.init(params), [], None
  for batch in batches:
    params, opt_state, loss, norms = step(params, opt_state, batch)
    losses.append(float(loss))
    norms = jax.device_get(norms)  # NumPy from here: nothing more to compile.
    grad_norms = norms if grad_norms is None else jax.tree.map(max, grad_norms, norms)
  return params, losses, grad_norms


def check(params, losses, reference, reference_losses, grad_norms) -> bool:
  """Same losses, and same params on every leaf whose gradient is not noise.

  A leaf the loss does not depend on (an attention key bias: softmax ignores
  it) gets a gradient of float32 rounding noise, which Adam divides by its own
  tiny scale into steps of real size in random directions: compare those
  leaves' gradients, not their params."""
  loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True))
  scale = max(float(n) for n in jax.tree.leaves(grad_norms))
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  worst, skipped = 0.0, []
  for (path, a), b, g in zip(
    paths, jax.tree.leaves(reference), jax.tree.leaves(grad_norms), strict=True
  ):
    if float(g) <= 1e-6 * scale:
      skipped.append(jax.tree_util.keystr(path, simple=True, separator="/"))
      skipped[-1] = skipped[-1].removesuffix("/value")  # nnx.Param's array
      continue
    a, b = np.asarray(a), np.asarray(b)
    worst = max(worst, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
  print(f"\nagainst whole-batch training ({len(losses)} updates, float32):")
  print(f"  largest loss difference               {loss_diff:.1e}")
  print(f"  largest params difference on a leaf   {worst:.1e}  (||a - b|| / ||b||)")
  print(f"  leaves with only rounding-noise gradients, not compared: {skipped}")
  ok = loss_diff <= 1e-4 and worst <= 1e-4
  print("  same training: " + ("yes" if ok else "NO"))
  return ok


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--windows", type=int, default=12, help="optimizer updates")
  parser.add_argument("--k", type=int, default=4, help="micro-batches per update")
  parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--text",
    type=pathlib.Path,
    help="a text file (default: a public-domain text shipped with optax_accum)",
  )
  args = parser.parse_args(argv)
  if args.k < 1 or BATCH % args.k:
    parser.error(f"--k must divide the batch of {BATCH} sequences, got {args.k}")
  if args.text is None:
    text = importlib.resources.files("optax_accum").joinpath("data/corpus.txt")
  else:
    text = args.text
  sequences, vocab = read_sequences(text.read_text())

  start = time.perf_counter()
  rng = np.random.default_rng(args.seed)
  batches = [make_batch(sequences, rng) for _ in range(args.windows)]
  # Built under jit: one compiled program draws every initial weight.
  model = nnx.jit(lambda: CausalLM(len(vocab), args.layers, nnx.Rngs(args.seed)))()
  graphdef, params = nnx.split(model, nnx.Param)
  loss_fn = make_loss_fn(graphdef)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(
    f"{n_params} params, {len(vocab)} characters; {args.windows} updates of "
    f"{BATCH} sequences in {args.k} micro-batches of {BATCH // args.k}"
  )
  trained, losses = train(params, loss_fn, batches, args.k)
  reference, reference_losses, grad_norms = whole_batch(params, loss_fn, batches)
  ok = check(trained, losses, reference, reference_losses, grad_norms)
  print(f"({time.perf_counter() - start:.0f} s)")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

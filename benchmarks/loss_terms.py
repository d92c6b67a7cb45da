"""What loss terms cost: XLA's analysis of the train step's programs, one
weight against three terms that each keep their own (issue 28).

The model is a small causal LM-like network (embedding, two tanh layers, a
vocabulary head) on padded sequences. Three objectives, each compiled for the
same micro-batch:

- ``one weight``: the three terms added into one loss with the token count as
  its weight (what a user without terms writes; wrong for two of the terms);
- ``terms``: the same three terms under ``MultiSteps(terms=...)``;
- ``one term``: the cross-entropy alone (the single-term step).

Figures are per call of each program, from ``cost_analysis()`` and
``memory_analysis()``: deterministic, so the ratios hold on any run.

  python -m benchmarks.loss_terms
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

VOCAB, WIDTH, SEQ, ROWS, K = 512, 256, 64, 16, 4
TERMS = ("ce", "kl", "aux")


def init_params(seed: int = 0) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed), 4)
  scale = WIDTH**-0.5
  return {
    "embed": jax.random.normal(keys[0], (VOCAB, WIDTH)),
    "w1": jax.random.normal(keys[1], (WIDTH, WIDTH)) * scale,
    "w2": jax.random.normal(keys[2], (WIDTH, WIDTH)) * scale,
    "head": jax.random.normal(keys[3], (WIDTH, VOCAB)) * scale,
  }


def batch(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (ROWS, SEQ + 1))
  lengths = rng.integers(1, SEQ + 1, (ROWS, 1))
  mask = (np.arange(SEQ)[None] < lengths).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _parts(params, batch):
  h = jnp.tanh(params["embed"][batch["inputs"]] @ params["w1"])
  h = jnp.tanh(h @ params["w2"])
  logits = h @ params["head"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["mask"]
  # A per-sequence penalty on the predicted distribution (a KL to uniform).
  logp = jax.nn.log_softmax(logits)
  kl = (jnp.exp(logp) * (logp + jnp.log(VOCAB))).sum(-1)
  per_sequence = (kl * mask).sum(1) / jnp.maximum(mask.sum(1), 1)
  aux = 1e-3 * jnp.sum(params["w1"] ** 2)  # One value per micro-batch.
  tokens, sequences = mask.sum(), (mask.sum(1) > 0).sum().astype(jnp.float32)
  return {
    "ce": ((nll * mask).sum() / jnp.maximum(tokens, 1), tokens),
    "kl": (per_sequence.sum() / jnp.maximum(sequences, 1), sequences),
    "aux": (aux, jnp.float32(1)),
  }


def terms_loss(params, batch):
  return _parts(params, batch)


def one_weight_loss(params, batch):
  terms = _parts(params, batch)
  return sum(v for v, _ in terms.values()), terms["ce"][1]


def one_term_loss(params, batch):
  return _parts(params, batch)["ce"]


def analyse(loss_fn, terms):
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K, terms=terms)
  step = optax_accum.make_train_step(loss_fn, opt)
  params = init_params()
  state = step.init(params)
  row = {}
  for program in ("accumulate", "update"):
    compiled = step.lower(params, state, batch(), program=program).compile()
    cost = compiled.cost_analysis()
    memory = compiled.memory_analysis()
    row[program] = (
      float(cost["flops"]),
      float(cost["bytes accessed"]),
      memory.argument_size_in_bytes + memory.temp_size_in_bytes,
    )
  return row


def main() -> None:
  params = sum(x.size for x in jax.tree.leaves(init_params()))
  print(
    f"loss terms: {params / 1e6:.2f}M params, micro-batch {ROWS}x{SEQ} tokens, "
    f"k={K}, AdamW; per program call, from XLA's analyses"
  )
  rows = {
    "one term (ce)": analyse(one_term_loss, None),
    "one weight (3 terms summed)": analyse(one_weight_loss, None),
    "terms=(ce, kl, aux)": analyse(terms_loss, TERMS),
  }
  base = rows["one weight (3 terms summed)"]
  print(
    f"{'objective':30s} {'program':>10s} {'GFLOP':>8s} {'x':>5s} "
    f"{'MB accessed':>12s} {'x':>5s} {'MB args+temp':>13s} {'x':>5s}"
  )
  for name, row in rows.items():
    for program, (flops, accessed, memory) in row.items():
      f0, a0, m0 = base[program]
      print(
        f"{name:30s} {program:>10s} {flops / 1e9:8.3f} {flops / f0:5.2f} "
        f"{accessed / 1e6:12.1f} {accessed / a0:5.2f} {memory / 1e6:13.1f} "
        f"{memory / m0:5.2f}"
      )


if __name__ == "__main__":
  main()

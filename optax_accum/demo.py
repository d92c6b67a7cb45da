"""Whole batch vs ``optax.MultiSteps`` vs ``optax_accum``, on a tiny character LM.

Run with ``python -m optax_accum.demo`` (``make demo``). A one-layer causal
transformer (Flax NNX) learns characters of a small public-domain corpus
shipped with the package (the Gettysburg Address, 1863, and the opening of the
US Declaration of Independence, 1776). Sequences have very different lengths,
padded and masked. It trains three ways, with the same data order and the same
number of AdamW updates:

1. the whole batch per update (the reference);
2. ``optax.MultiSteps`` on per-micro-batch mean losses (the common mistake);
3. ``optax_accum`` token-weighted, through ``make_train_step``.

It prints the first window's gradient error, the final loss and the params'
distance from the reference, and writes to ``--out`` the loss curves, each
run's distance from the reference after every update (log scale) and the
learning rate.
"""

from __future__ import annotations

import argparse
import importlib.resources
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

SEQ_LEN, BATCH, WIDTH, HEADS = 48, 16, 64, 4


def corpus() -> str:
  return (
    importlib.resources.files("optax_accum").joinpath("data/corpus.txt").read_text()
  )


def make_batches(
  text: str, steps: int, seed: int
) -> tuple[list[dict[str, np.ndarray]], int]:
  """``steps`` batches of random windows of the text, half of them 2-8 chars."""
  vocab = sorted(set(text))
  ids = np.array([vocab.index(c) for c in text])
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(steps):
    starts = rng.integers(0, len(ids) - SEQ_LEN - 1, BATCH)
    tokens = np.stack([ids[s : s + SEQ_LEN + 1] for s in starts])
    short = rng.random(BATCH) < 0.5
    lengths = np.where(
      short, rng.integers(2, 9, BATCH), rng.integers(SEQ_LEN - 8, SEQ_LEN + 2, BATCH)
    )
    mask = np.arange(SEQ_LEN + 1)[None, :] < lengths[:, None]
    batches.append({"tokens": tokens, "mask": mask})
  return batches, len(vocab)


def make_model(vocab: int, seed: int) -> Any:
  from flax import nnx

  class CharTransformer(nnx.Module):
    """One pre-norm causal self-attention block and an MLP."""

    def __init__(self, rngs: nnx.Rngs):
      self.embed = nnx.Embed(vocab, WIDTH, rngs=rngs)
      self.position = nnx.Embed(SEQ_LEN, WIDTH, rngs=rngs)
      self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs)
      self.proj = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
      self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.mlp_in = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
      self.mlp_out = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
      self.head = nnx.Linear(WIDTH, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
      batch, time = tokens.shape
      h = self.embed(tokens) + self.position(jnp.arange(time))[None]
      q, k, v = jnp.split(self.qkv(self.norm1(h)), 3, axis=-1)
      split = lambda x: x.reshape(batch, time, HEADS, WIDTH // HEADS)  # noqa: E731
      scores = (
        jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / (WIDTH // HEADS) ** 0.5
      )
      causal = jnp.tril(jnp.ones((time, time), bool))
      scores = jnp.where(causal[None, None], scores, -1e9)
      attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), split(v))
      h = h + self.proj(attended.reshape(batch, time, WIDTH))
      h = h + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(h))))
      return self.head(h)

  return nnx.split(CharTransformer(nnx.Rngs(seed)), nnx.Param)


def make_loss(graphdef: Any) -> Callable[[Any, Any], tuple[jax.Array, jax.Array]]:
  from flax import nnx

  def loss_fn(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    """Token-mean cross-entropy over the targets, and how many there are."""
    logits = nnx.merge(graphdef, params)(batch["tokens"][:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["tokens"][:, 1:]
    )
    targets = optax_accum.causal_lm_target_mask(batch["mask"]).astype(nll.dtype)
    return (nll * targets).sum() / targets.sum(), targets.sum()

  return loss_fn


def _rel(a: Any, b: Any) -> float:
  """``||a - b|| / ||b||`` over whole trees, on the host in float64."""
  a, b = (
    np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(t)])
    for t in jax.device_get((a, b))
  )
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _micro(batch: dict[str, np.ndarray], k: int) -> list[dict[str, np.ndarray]]:
  return [{name: value[i::k] for name, value in batch.items()} for i in range(k)]


def train(
  name: str,
  loss_fn: Callable,
  params: Any,
  batches: list,
  k: int,
  adamw: Any,
  progress: Callable[[], Any],
  reference: Sequence[Any] | None = None,
) -> dict[str, Any]:
  """One run; returns final params, and per update the loss, the learning rate,
  the params and their distance from ``reference`` (the whole batch's params
  after the same update; ``reference=None`` is the whole-batch run itself)."""
  copy = jax.tree.map(jnp.copy, params)
  if name == "optax_accum":
    opt = optax_accum.MultiSteps(adamw, k)
    step = optax_accum.make_train_step(loss_fn, opt)

    def micro_step(p: Any, s: Any, b: Any) -> tuple[Any, Any, Any]:
      return step(p, s, b)

  else:
    opt = optax.MultiSteps(adamw, k) if name == "optax.MultiSteps" else adamw

    @jax.jit
    def micro_step(p: Any, s: Any, b: Any) -> tuple[Any, Any, Any]:
      grads, _ = jax.grad(loss_fn, has_aux=True)(p, b)
      updates, s = opt.update(grads, s, p)
      return optax.apply_updates(p, updates), s, None

  evaluate = jax.jit(loss_fn)
  state, losses, lrs, trajectory, distances = opt.init(copy), [], [], [], []
  for update, batch in enumerate(batches):
    for micro_batch in [batch] if name == "whole batch" else _micro(batch, k):
      copy, state, _ = micro_step(copy, state, micro_batch)
    losses.append(float(evaluate(copy, batch)[0]))  # The whole batch, after the update.
    progress()
    lrs.append(float(optax_accum.get_hyperparams(state)["learning_rate"]))
    if reference is None:
      trajectory.append(copy)  # Not donated: the whole-batch step returns new arrays.
      distances.append(0.0)
    else:
      distances.append(_rel(copy, reference[update]))
  return {
    "params": copy,
    "losses": losses,
    "lrs": lrs,
    "trajectory": trajectory,
    "distances": distances,
  }


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
  args = _parse_args(argv)
  batches, vocab = make_batches(corpus(), args.steps, args.seed)
  graphdef, params = make_model(vocab, args.seed)
  loss_fn = make_loss(graphdef)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, 3e-3, max(args.steps // 10, 1), args.steps
  )
  # eps=1e-6, not 1e-8: Adam divides by sqrt(v) + eps, so with a tiny eps the
  # float32 rounding in near-zero gradients (rare characters) is amplified
  # into visibly different params (3e-4 after 60 updates instead of 3e-6).
  adamw = optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax_accum.progress_schedule(schedule), weight_decay=0.01, eps=1e-6
  )
  grad_errors = _first_window_grad_errors(loss_fn, params, batches[0], args.k)
  runs = _train_all(list(grad_errors), loss_fn, params, batches, args.k, adamw)
  results = _print_results(runs, grad_errors, args.steps, args.k)
  _plot(runs, args.out)
  return results


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--steps", type=int, default=60, help="optimizer updates (default 60)"
  )
  parser.add_argument(
    "--k", type=int, default=4, help="micro-batches per update (default 4)"
  )
  parser.add_argument(
    "--seed", type=int, default=0, help="data and init seed (default 0)"
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("out"),
    help="folder for demo.png (default out/)",
  )
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error(f"--steps must be >= 2, got {args.steps}")
  if args.k < 1 or BATCH % args.k:
    parser.error(f"--k must divide the batch of {BATCH} sequences, got {args.k}")
  return args


def _first_window_grad_errors(
  loss_fn: Callable, params: Any, batch: dict[str, np.ndarray], k: int
) -> dict[str, float]:
  """The first window's gradient: whole batch vs each way of accumulating it."""
  grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True))
  whole_grad, _ = grad_fn(params, batch)
  micro = [grad_fn(params, b) for b in _micro(batch, k)]
  uniform = jax.tree.map(lambda *g: sum(g) / k, *[g for g, _ in micro])
  weighted = jax.tree.map(
    lambda *g: sum(g), *[jax.tree.map(lambda x, w=w: w * x, g) for g, w in micro]
  )
  total = sum(w for _, w in micro)
  return {
    "whole batch": 0.0,
    "optax.MultiSteps": _rel(uniform, whole_grad),
    "optax_accum": _rel(jax.tree.map(lambda x: x / total, weighted), whole_grad),
  }


def _train_all(
  names: list[str],
  loss_fn: Callable,
  params: Any,
  batches: list,
  k: int,
  adamw: Any,
) -> dict[str, dict[str, Any]]:
  """Each run of ``names`` in turn (the whole batch first), with a progress bar."""
  try:
    from tqdm import tqdm

    bar = tqdm(total=len(names) * len(batches), desc="training", unit="update")
  except ImportError:  # The progress bar is optional.
    bar = None
  runs: dict[str, dict[str, Any]] = {}
  for name in names:
    if bar is not None:
      bar.set_postfix_str(name)
    tick = bar.update if bar is not None else (lambda: None)
    whole = runs["whole batch"]["trajectory"] if runs else None
    runs[name] = train(name, loss_fn, params, batches, k, adamw, tick, whole)
  if bar is not None:
    bar.close()
  return runs


def _print_results(
  runs: dict[str, dict[str, Any]], grad_errors: dict[str, float], steps: int, k: int
) -> dict[str, dict[str, Any]]:
  """Prints the table of runs against the whole batch; returns its numbers."""
  reference = runs["whole batch"]
  print(f"\n{steps} AdamW updates of {BATCH} sequences, k={k} micro-batches")
  columns = ("first-window grad error", "final loss", "params diff")
  print(f"\n{'run':<18} {columns[0]:>24} {columns[1]:>11} {columns[2]:>12}")
  results: dict[str, dict[str, Any]] = {}
  for name, run in runs.items():
    r = results[name] = {
      "grad_error": grad_errors[name],
      "final_loss": run["losses"][-1],
      "params_diff": _rel(run["params"], reference["params"]),
      "distances": run["distances"],  # The same, after every update.
    }
    numbers = (
      f"{r['grad_error']:>24.2e} {r['final_loss']:>11.4f} {r['params_diff']:>12.2e}"
    )
    print(f"{name:<18} {numbers}")
  print("\n(errors and diffs relative to the whole-batch run: ||a - b|| / ||b||)")
  return results


def _plot(runs: dict[str, dict[str, Any]], out: pathlib.Path) -> None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot")
    return
  fig, (ax_loss, ax_distance, ax_lr) = plt.subplots(1, 3, figsize=(15, 3.6))
  updates = np.arange(1, len(runs["whole batch"]["losses"]) + 1)
  for color, (name, run) in enumerate(runs.items()):
    style = {"color": f"C{color}", "label": name}
    ax_loss.plot(
      updates, run["losses"], linestyle="--" if name == "optax_accum" else "-", **style
    )
    if name != "whole batch":  # Its own distance is 0, off a log scale.
      distances = np.asarray(run["distances"])
      # An update that happens to land exactly on the whole batch's params is
      # left out rather than drawn at some arbitrary floor.
      ax_distance.plot(updates, np.where(distances > 0, distances, np.nan), **style)
  ax_loss.set_xlabel("update")
  ax_loss.set_ylabel("batch token-mean loss")
  ax_loss.legend()
  ax_distance.set_yscale("log")
  ax_distance.set_xlabel("update")
  ax_distance.set_ylabel("||params - whole|| / ||whole||")
  ax_distance.set_title("distance from the whole-batch run", fontsize=10)
  ax_distance.legend()
  ax_lr.plot(updates, runs["optax_accum"]["lrs"], color="C2")
  ax_lr.set_xlabel("update")
  ax_lr.set_ylabel("learning rate")
  fig.tight_layout()
  out.mkdir(parents=True, exist_ok=True)
  fig.savefig(out / "demo.png", dpi=100)
  print(f"wrote {out / 'demo.png'}")


if __name__ == "__main__":
  main()

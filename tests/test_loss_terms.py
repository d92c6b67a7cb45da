"""Loss terms that each keep their own weight over the window (issue 28).

Three terms with different counts: a token-mean cross-entropy (weight: tokens),
a per-sequence penalty (weight: sequences with a token), and a per-micro-batch
regulariser (weight: 1). The oracle is the whole window's objective, each term
normalised by its own count over the whole window, computed from the whole
batch where the term is a mean over its rows.
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum

TERMS = ("ce", "penalty", "aux")
WINDOWS = 3


def _term_values(params, batch):
  """Each term's per-item values and counts over ``batch``'s rows."""
  losses, mask = toy_lm.token_losses(params, batch)
  hidden = jnp.tanh(params["embed"][batch["inputs"]])
  per_sequence = (hidden**2).mean(axis=(1, 2))  # Any param-dependent penalty.
  has_tokens = (mask.sum(axis=1) > 0).astype(jnp.float32)
  return losses, mask, per_sequence * has_tokens, has_tokens


def term_loss(params, batch):
  """``{name: (mean over its own items, their count)}`` for one micro-batch."""
  losses, mask, penalty, sequences = _term_values(params, batch)
  tokens = mask.sum()
  aux = 0.1 * jnp.sum(params["head"]["w"] ** 2) * (1 + tokens / 100)
  return {
    "ce": (losses.sum() / jnp.maximum(tokens, 1), tokens),
    "penalty": (penalty.sum() / jnp.maximum(sequences.sum(), 1), sequences.sum()),
    "aux": (aux, jnp.float32(1)),
  }


def window_objective(params, micro_batches, replicas=1):
  """The window's objective: ce and penalty over the whole batch at once, aux
  the mean over the calls of ``loss_fn`` (each replica's rows of each
  micro-batch, under ``axis_name``) of its value there."""
  whole = {
    n: jnp.concatenate([mb[n] for mb in micro_batches]) for n in micro_batches[0]
  }
  losses, mask, penalty, sequences = _term_values(params, whole)
  pieces = [
    jax.tree.map(
      lambda x, r=r: x[r * len(x) // replicas : (r + 1) * len(x) // replicas], mb
    )
    for mb in micro_batches
    for r in range(replicas)
  ]
  auxes = [term_loss(params, piece)["aux"][0] for piece in pieces]
  return (
    losses.sum() / mask.sum()
    + penalty.sum() / sequences.sum()
    + sum(auxes) / len(auxes)
  )


def _windows(sizes, seed=0):
  """Micro-batches of ``sizes`` rows each, window by window; one micro-batch of
  each window holds only padding (no tokens, no sequences)."""
  windows = []
  for w in range(WINDOWS):
    batch = toy_lm.make_batch(seed=seed + w, batch=sum(sizes))
    starts = np.cumsum([0, *sizes])
    bounds = itertools.pairwise(starts)
    window = [{n: v[a:b] for n, v in batch.items()} for a, b in bounds]
    window[1]["mask"] = np.zeros_like(window[1]["mask"])
    windows.append(window)
  return windows


def _whole_batch_run(windows, tx, replicas=1):
  params, state = toy_lm.init_params(seed=0), tx.init(toy_lm.init_params(seed=0))
  step = jax.jit(
    lambda p, s, w: _apply(tx, p, s, jax.grad(window_objective)(p, w, replicas)),
  )
  for window in windows:
    params, state = step(params, state, window)
  return params


def _apply(tx, params, state, grads):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def _adamw():
  return optax.adamw(3e-2, weight_decay=0.1)


def _train(loss_fn, windows, mode):
  """Params and the last metrics after the windows, each one update, with
  AdamW and the three terms."""
  opt = optax_accum.MultiSteps(_adamw(), len(windows[0]), terms=TERMS)
  step = optax_accum.make_train_step(loss_fn, opt, mode=mode)
  params = toy_lm.init_params(seed=0)
  state = step.init(params)
  for window in windows:
    if mode == "scan":
      window = [jax.tree.map(lambda *x: np.stack(x), *window)]
    for batch in window:
      params, state, metrics = step(params, state, batch)
    assert bool(metrics["updated"]), metrics
  return params, metrics


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_each_term_keeps_its_own_weight_over_the_window(mode):
  sizes = [5, 5, 5, 5] if mode == "scan" else [1, 4, 9, 2]
  windows = _windows(sizes)
  params, metrics = _train(term_loss, windows, mode)
  whole = _whole_batch_run(windows, _adamw())
  assert toy_lm.max_rel_diff(toy_lm.init_params(seed=0), whole) > 1e-2
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5
  # Each term's window mean and weight; the loss is their sum.
  last = windows[-1]
  want = term_loss(params, last[0])  # Shapes only; values below.
  assert set(metrics["terms"]) == set(want)
  tokens = sum(mb["mask"].sum() for mb in last)
  np.testing.assert_allclose(metrics["terms"]["ce"]["weight"], tokens)
  np.testing.assert_allclose(metrics["terms"]["aux"]["weight"], len(sizes))
  np.testing.assert_allclose(metrics["weight"], tokens)  # The first term's.
  total = sum(float(t["loss"]) for t in metrics["terms"].values())
  np.testing.assert_allclose(float(metrics["loss"]), total, rtol=1e-6)


def test_one_weight_for_all_terms_is_what_goes_wrong():
  """The test can fail: the same terms under one shared weight (tokens) give a
  different update."""
  sizes = [3, 3, 3, 3]  # Token counts still differ (one holds only padding).
  windows = _windows(sizes)

  def shared(params, batch):
    terms = term_loss(params, batch)
    return sum(v for v, _ in terms.values()), terms["ce"][1]

  opt = optax_accum.MultiSteps(_adamw(), len(sizes))
  step = optax_accum.make_train_step(shared, opt)
  params = toy_lm.init_params(seed=0)
  state = step.init(params)
  for window in windows:
    for micro_batch in window:
      params, state, _ = step(params, state, micro_batch)
  assert toy_lm.max_rel_diff(params, _whole_batch_run(windows, _adamw())) > 1e-3


def test_the_optax_spelling_takes_dicts_by_term():
  """`MultiSteps.update` with each term's gradient, weight and loss."""
  sizes = [3, 3, 3, 3]
  windows = _windows(sizes)
  opt = optax_accum.MultiSteps(_adamw(), len(sizes), terms=TERMS)
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)

  @jax.jit
  def micro_step(params, state, batch):
    terms = {}
    for name in TERMS:
      value, grads = jax.value_and_grad(lambda p, n=name: term_loss(p, batch)[n][0])(
        params
      )
      terms[name] = (grads, term_loss(params, batch)[name][1], value)
    grads, weight, loss = ({n: t[i] for n, t in terms.items()} for i in range(3))
    updates, state = opt.update(grads, state, params, weight=weight, loss=loss)
    return optax.apply_updates(params, updates), state

  for window in windows:
    for micro_batch in window:
      params, state = micro_step(params, state, micro_batch)
  assert int(state.gradient_step) == WINDOWS
  assert toy_lm.max_rel_diff(params, _whole_batch_run(windows, _adamw())) <= 1e-5


def test_terms_errors():
  with pytest.raises(ValueError, match=r"`terms` must not repeat a name"):
    optax_accum.MultiSteps(_adamw(), 2, terms=("a", "a"))
  with pytest.raises(ValueError, match=r"grad_reduction='mean'"):
    optax_accum.MultiSteps(_adamw(), 2, grad_reduction="sum", terms=("a",))
  opt = optax_accum.MultiSteps(_adamw(), 2, terms=("ce", "kl"))
  params = toy_lm.init_params(seed=0)
  batch = toy_lm.make_batch(seed=0, batch=4)
  step = optax_accum.make_train_step(term_loss, opt)
  with pytest.raises(ValueError, match=r"one \(value, weight\) pair per loss term"):
    step(params, step.init(params), batch)
  plain = optax_accum.make_train_step(term_loss, optax_accum.MultiSteps(_adamw(), 2))
  with pytest.raises(ValueError, match=r"declare them with MultiSteps"):
    plain(params, plain.init(params), batch)
  state = opt.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match=r"`weight` must be a dict with one entry"):
    opt.update({"ce": grads, "kl": grads}, state, params, weight=3.0)
  chex.assert_trees_all_equal_structs(state.acc_grads, (params, params))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("axis_name", [None, "data"])
@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_terms_under_data_parallelism(mode, axis_name):
  """A batch split over 8 devices, with and without `axis_name`: each term's
  weight is summed over the replicas too. With `axis_name` the per-call term
  counts one per replica and micro-batch (each replica's `loss_fn` sees its
  own rows); the token and sequence terms are the same either way."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sizes = [16, 16, 16, 16]  # Token counts differ; one holds only padding.
  windows = _windows(sizes, seed=7)
  opt = optax_accum.MultiSteps(_adamw(), len(sizes), terms=TERMS, axis_name=axis_name)
  step = optax_accum.make_train_step(term_loss, opt, mode=mode)
  params = toy_lm.init_params(seed=0)
  state = step.init(params)
  for window in windows:
    if mode == "scan":
      stacked = jax.tree.map(lambda *x: np.stack(x), *window)
      placed = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, "data")
      )
      params, state, metrics = step(params, state, jax.device_put(stacked, placed))
    else:
      for micro_batch in window:
        params, state, metrics = step(params, state, jax.device_put(micro_batch, rows))
  assert int(metrics["update_count"]) == WINDOWS
  whole = _whole_batch_run(windows, _adamw(), replicas=8 if axis_name else 1)
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5
  np.testing.assert_allclose(
    metrics["terms"]["aux"]["weight"], 4 * (8 if axis_name else 1)
  )


def _reference_window(micro_batches, n_terms):
  """The documented semantics in float64 NumPy: the window's gradient and its
  objective, or ``None`` for a window that applies no update."""
  acc = np.zeros((n_terms, 3))
  weights, losses = np.zeros(n_terms), np.zeros(n_terms)
  for g, w, v in micro_batches:
    if not np.all(np.isfinite(w) & (w >= 0)):
      continue  # A bad weight in any term drops the micro-batch.
    adds = w > 0
    acc[adds] += w[adds, None] * g[adds]
    weights[adds] += w[adds]
    losses[adds] += w[adds] * v[adds]
  some = weights > 0
  if not some.any():
    return None
  grad = (acc[some] / weights[some, None]).sum(0)
  return grad, float((losses[some] / weights[some]).sum())


def _draw_micro_batch(rng, n_terms):
  g = rng.normal(size=(n_terms, 3)) * 10.0 ** rng.integers(-3, 4, (n_terms, 1))
  w = rng.choice([0.0, 1.0, 3.0, 17.0, 250.0], size=n_terms)
  if rng.random() < 0.1:
    w[rng.integers(n_terms)] = rng.choice([np.nan, -2.0])
  return g, w, rng.normal(size=n_terms)


def _linear_terms(n_terms):
  """A loss whose term ``i`` has value ``v[i]`` and gradient ``g[i]``."""

  def loss_fn(params, batch):
    out = {}
    for i in range(n_terms):
      dot = jnp.sum(params["p"] * batch["g"][i])
      zero = dot - jax.lax.stop_gradient(dot)  # Exactly 0, with gradient g[i].
      out[f"t{i}"] = (batch["v"][i] + zero, batch["w"][i])
    return out

  return loss_fn


@pytest.mark.parametrize("seed", range(9))
def test_terms_match_a_float64_reference(seed):
  """Random terms, weights (zeros, a NaN or negative now and then), gradient
  scales and window lengths, through each path in float64: the update and the
  objective agree with the reference to near machine precision."""
  rng = np.random.default_rng(seed)
  n_terms, k = int(rng.integers(1, 4)), int(rng.integers(1, 5))
  path = ["update", "stream", "scan"][seed % 3]
  names = tuple(f"t{i}" for i in range(n_terms))
  with jax.enable_x64(True):
    opt = optax_accum.MultiSteps(optax.sgd(1.0), k, terms=names)
    mode = "stream" if path == "update" else path
    step = optax_accum.make_train_step(_linear_terms(n_terms), opt, mode=mode)
    params = {"p": jnp.zeros(3, jnp.float64)}
    state = opt.init(params)
    for _ in range(3):
      window = [_draw_micro_batch(rng, n_terms) for _ in range(k)]
      batches = [{"g": g, "w": w, "v": v} for g, w, v in window]
      before = np.asarray(params["p"])  # The step donates params.
      if path == "scan":
        stacked = jax.tree.map(lambda *x: np.stack(x), *batches)
        params, state, metrics = step(params, state, stacked)
      elif path == "stream":
        for b in batches:
          params, state, metrics = step(params, state, b)
      else:
        for g, w, v in window:
          by_name = [dict(zip(names, x, strict=True)) for x in (list(g), w, v)]
          grads = {n: {"p": jnp.asarray(x)} for n, x in by_name[0].items()}
          updates, state = opt.update(
            grads, state, params, weight=by_name[1], loss=by_name[2]
          )
          params = optax.apply_updates(params, updates)
        metrics = {"updated": state.updated, "loss": state.last_window_loss}
      expected = _reference_window(window, n_terms)
      assert bool(metrics["updated"]) == (expected is not None)
      if expected is not None:
        grad, objective = expected
        scale = np.abs(window[0][0]).max() + np.abs(grad).max()
        np.testing.assert_allclose(
          before - params["p"], grad, rtol=0, atol=1e-13 * scale
        )
        np.testing.assert_allclose(
          float(metrics["loss"]), objective, rtol=1e-12, atol=1e-12
        )


def _unguarded(params, batch):
  """``term_loss`` as users write it: each mean divides by its count, so a
  micro-batch of padding only gives 0/0 = NaN, at weight 0."""
  losses, mask, penalty, sequences = _term_values(params, batch)
  terms = term_loss(params, batch)
  terms["ce"] = (losses.sum() / mask.sum(), mask.sum())
  terms["penalty"] = (penalty.sum() / sequences.sum(), sequences.sum())
  return terms


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_a_term_over_no_items_is_nan_and_adds_nothing(mode):
  """A micro-batch of padding only, last in its window: ce and penalty are
  NaN at weight 0, aux still counts, and the window updates as the whole
  batch does. (On this loss XLA also cleared the NaN that one pullback of all
  terms let into aux's gradient; `test_reference.py::test_a_nonfinite_term_
  of_weight_0_leaves_the_others_alone` is the loss where it did not.)"""
  sizes = [3, 3, 3, 3]
  windows = [[*w[:1], *w[2:], w[1]] for w in _windows(sizes)]
  params, metrics = _train(_unguarded, windows, mode)
  assert int(metrics["skipped_windows"]) == int(metrics["skipped_micro_batches"]) == 0
  assert toy_lm.max_rel_diff(params, _whole_batch_run(windows, _adamw())) <= 1e-5


def test_terms_of_an_nnx_model_with_attention():
  """An NNX model with causal attention, split and merged around the step, a
  token CE, a per-sequence penalty and a per-micro-batch aux term: within f32
  rounding of the whole window's objective after two AdamW windows (the key
  bias, whose gradient softmax makes rounding noise, left out)."""
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      width = toy_lm.WIDTH
      self.embed = nnx.Embed(toy_lm.VOCAB, width, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(2, width, decode=False, rngs=rngs)
      self.head = nnx.Linear(width, toy_lm.VOCAB, rngs=rngs)

    def __call__(self, inputs):
      h = self.embed(inputs)
      return self.head(jnp.tanh(h + self.attn(h, mask=nnx.make_causal_mask(inputs))))

  graphdef, params0 = nnx.split(Model(nnx.Rngs(0)), nnx.Param)

  def terms_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"])
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    mask = jnp.asarray(batch["mask"], jnp.float32)
    rows = mask.sum(axis=1)
    has_tokens = (rows > 0).astype(jnp.float32)
    per_sequence = (nll * mask).sum(axis=1) / jnp.maximum(rows, 1) * has_tokens
    embed = params["embed"]["embedding"][...]
    return {
      "ce": ((nll * mask).sum() / jnp.maximum(mask.sum(), 1), mask.sum()),
      "penalty": (
        per_sequence.sum() / jnp.maximum(has_tokens.sum(), 1),
        has_tokens.sum(),
      ),
      "aux": (0.1 * jnp.mean(embed**2), jnp.float32(1)),
    }

  def objective(params, window):
    whole = {n: jnp.concatenate([mb[n] for mb in window]) for n in window[0]}
    per = [terms_fn(params, mb) for mb in window]
    tokens = sum(t["ce"][1] for t in per)
    sequences = sum(t["penalty"][1] for t in per)
    return (
      sum(t["ce"][0] * t["ce"][1] for t in per) / tokens
      + sum(t["penalty"][0] * t["penalty"][1] for t in per) / sequences
      + terms_fn(params, whole)["aux"][0]
    )

  windows = _windows([1, 4, 9, 2])[:2]
  tx = _adamw()
  step = optax_accum.make_train_step(
    terms_fn, optax_accum.MultiSteps(tx, 4, terms=TERMS)
  )
  params, state = params0, step.init(params0)
  whole, whole_state = jax.tree.map(jnp.copy, params0), tx.init(params0)
  whole_grad = jax.jit(jax.grad(objective))
  for window in windows:
    for micro_batch in window:
      params, state, metrics = step(params, state, micro_batch)
    whole, whole_state = _apply(tx, whole, whole_state, whole_grad(whole, window))
  assert int(metrics["update_count"]) == 2
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
  ]
  pairs = zip(paths, jax.tree.leaves(params), jax.tree.leaves(whole), strict=True)
  compared = 0
  for path, a, b in pairs:
    if "'key'" in path and "'bias'" in path:  # Rounding noise, Adam-normalised.
      continue
    scale = np.abs(np.asarray(b)).max()
    assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * scale, path
    compared += 1
  assert compared == len(paths) - 1

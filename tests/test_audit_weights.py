"""Issue 69, "The weight a loss needs": `audit` finds the weight that reproduces
the whole batch, and says when `loss_fn`'s is another.

`MultiSteps`' `weight` is the count the loss divides by: tokens for a token
mean, rows for a mean of per-row means (EasyLM's loss), all positions for a
mean over every position, and `grad_reduction="window_mean"` for a loss divided
by a constant. The oracle is the whole batch itself: each loss's whole-batch
gradient is checked, in float64, to be the weighting the audit reports, and no
other. One small model (an embedding and a head), 16 rows of 8 positions with
three rows of padding only (rows and sequences differ), `k = 4`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

V, D, T, B, K = 11, 8, 8, 16, 4
ADAM = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


def make_batch(seed=0):
  """Half the rows 1-2 tokens long, half 4-8; rows 2, 7 and 9 padding only."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T + 1))
  lengths = np.where(
    rng.random(B) < 0.5, rng.integers(1, 3, B), rng.integers(4, T + 1, B)
  )
  lengths[[2, 7, 9]] = 0
  mask = np.arange(T)[None, :] < lengths[:, None]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


BATCH = make_batch()
# Micro-batch i holds rows i, i + 4, i + 8, i + 12 (the default split).
MICRO = [{n: v[i::K] for n, v in BATCH.items()} for i in range(K)]
TOKENS = np.array([m["mask"].sum() for m in MICRO], np.float64)
SEQUENCES = np.array([m["mask"].any(-1).sum() for m in MICRO], np.float64)
ROWS = np.full(K, B // K, np.float64)


def init_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "embed": jax.random.normal(k1, (V, D)),
    "head": jax.random.normal(k2, (D, V)) / 4,
  }


def _nll(params, batch):
  """Per-position cross-entropy, and the float mask of valid positions."""
  logits = jnp.tanh(params["embed"][batch["inputs"]]) @ params["head"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return nll, jnp.asarray(batch["mask"], nll.dtype)


def token_mean(params, batch):
  """The token mean, with the token count."""
  nll, mask = _nll(params, batch)
  return (nll * mask).sum() / jnp.maximum(mask.sum(), 1), mask.sum()


def easylm_loss(params, batch):
  """What EasyLM's `cross_entropy_loss_and_accuracy` computes (young-geng/EasyLM,
  `EasyLM/jax_utils.py`): each row's masked token mean, its valid count clipped
  to at least 1e-10, averaged over the rows (padding-only rows count, as 0).
  Returned with the token count, as the user who met issue 69 did."""
  nll, mask = _nll(params, batch)
  valid_text_length = jnp.maximum(mask.sum(-1), 1e-10)
  return jnp.mean((nll * mask).sum(-1) / valid_text_length), mask.sum()


def easylm_by_rows(params, batch):
  """The port: EasyLM's loss with the number of rows as its weight."""
  loss, _ = easylm_loss(params, batch)
  return loss, jnp.float32(batch["mask"].shape[0])


def per_sequence(weight):
  """A per-sequence average: each non-empty row's token mean, averaged over
  those rows, with the sequence count (or, wrongly, the token count)."""

  def loss(params, batch):
    nll, mask = _nll(params, batch)
    per_row = (nll * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1)
    sequences = (mask.sum(-1) > 0).sum().astype(jnp.float32)
    counts = {"sequences": sequences, "tokens": mask.sum()}
    return per_row.sum() / jnp.maximum(sequences, 1), counts[weight]

  return loss


PER_SEQUENCE, PER_SEQUENCE_BY_TOKENS = per_sequence("sequences"), per_sequence("tokens")


def position_mean(params, batch):
  """A mean over all positions, padding included (`jnp.mean(nll * mask)`),
  returned with the token count."""
  nll, mask = _nll(params, batch)
  return (nll * mask).mean(), mask.sum()


def summed(params, batch):
  """A summed loss divided by a constant, with the token count."""
  nll, mask = _nll(params, batch)
  return (nll * mask).sum() / 64.0, mask.sum()


# --- the oracle: the whole batch's gradient, in float64 ---------------------------


@functools.cache
def _gradients(loss_fn):
  """The whole batch's gradient and each micro-batch's, flat, in float64."""
  grad = jax.jit(jax.grad(loss_fn, has_aux=True))

  def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in tree])

  whole = flat(jax.tree.leaves(grad(init_params(), BATCH)[0]))
  micro = np.stack([flat(jax.tree.leaves(grad(init_params(), m)[0])) for m in MICRO])
  return whole, micro


def _off(loss_fn, coefficients):
  """How far `sum_i c_i g_i` is from the whole batch's gradient (relative)."""
  whole, micro = _gradients(loss_fn)
  return np.linalg.norm(np.asarray(coefficients) @ micro - whole) / np.linalg.norm(
    whole
  )


@pytest.mark.parametrize(
  ("loss_fn", "right", "wrong"),
  [
    (token_mean, TOKENS / TOKENS.sum(), ROWS / ROWS.sum()),
    (easylm_loss, ROWS / ROWS.sum(), TOKENS / TOKENS.sum()),
    (PER_SEQUENCE, SEQUENCES / SEQUENCES.sum(), TOKENS / TOKENS.sum()),
    (position_mean, ROWS / ROWS.sum(), TOKENS / TOKENS.sum()),
    (summed, np.ones(K), TOKENS / TOKENS.sum()),
  ],
  ids=["token mean", "EasyLM", "per sequence", "all positions", "summed"],
)
def test_each_loss_is_one_weighting_of_its_micro_batches(loss_fn, right, wrong):
  """The oracle the audit's verdicts rest on: each loss's whole-batch gradient
  is the weighting of its micro-batches' that its count gives, and not the
  other (float64 sums of float32 gradients)."""
  assert _off(loss_fn, right) < 1e-6
  assert _off(loss_fn, wrong) > 0.05


# --- the audit reports the weight the loss needs ---------------------------------


def _audit(loss_fn, optimizer=ADAM, **kwargs):
  return optax_accum.audit(loss_fn, optimizer, init_params(), BATCH, k=K, **kwargs)


def test_easylm_loss_with_token_weights_needs_weight_rows():
  """Issue 69: it was F10 with the fix CoupledLoss, its message printed the
  token shares on both sides, and its rounding floor came from the token
  weighting (23% off) so `other` said ok while the params were far off."""
  report = _audit(easylm_loss)
  assert report.found() == {"weight"}, str(report)
  weight = report.verdicts["weight"]
  assert "by their rows or positions [4, 4, 4, 4]" in weight.detail
  assert f"is {[int(n) for n in TOKENS]} (tokens)" in weight.detail
  assert "weight=n_rows" in weight.fix and "grad_reduction='mean'" in weight.fix
  assert "CoupledLoss" not in str(report)
  assert report.whole_batch_weighting == "rows or positions"
  np.testing.assert_allclose(report.whole_batch_weights, ROWS / ROWS.sum())
  # The two weightings compared, each its own vector.
  tokens = ", ".join(f"{x:.3g}" for x in TOKENS / TOKENS.sum())
  assert f"[0.25, 0.25, 0.25, 0.25], not [{tokens}]" in weight.detail
  assert f"micro-batches [{tokens}], as loss_fn's weight says" in report.grad_fit
  # The rounding allowance is the rows' weighting: rounding, far below the gap.
  assert report.rounding_diff < 1e-6
  assert report.params_diff > 1e3 * report.rounding_diff
  assert report.grad_error == pytest.approx(_off(easylm_loss, TOKENS / TOKENS.sum()))


@pytest.mark.parametrize(
  ("loss_fn", "name", "count"),
  [
    (easylm_by_rows, "rows", ROWS),
    (token_mean, "tokens", TOKENS),
    (PER_SEQUENCE, "sequences", SEQUENCES),
  ],
  ids=["EasyLM by rows", "token mean", "per sequence"],
)
def test_a_loss_with_its_own_count_as_weight_is_ok(loss_fn, name, count):
  report = _audit(loss_fn)
  assert report.ok, str(report)
  assert report.weight_name == name and report.as_declared
  assert report.verdicts["weight"].status == "ok"
  assert f"by their {name} {[int(n) for n in count]}" in (
    report.verdicts["weight"].detail
  )
  assert f"  {name} per micro-batch" in str(report)
  np.testing.assert_allclose(report.whole_batch_weights, count / count.sum())


def test_a_per_sequence_average_under_a_uniform_mean_is_f1_with_the_sequence_count():
  """optax.MultiSteps on a per-sequence average: F1, whose fix is the
  sequence count (it said the token count), in words that say sequences."""
  report = _audit(PER_SEQUENCE, optax.MultiSteps(ADAM, K))
  assert report.found() == {"F1"}, str(report)
  f1 = report.verdicts["F1"]
  lo, hi = int(SEQUENCES.min()), int(SEQUENCES.max())
  assert f"mean of micro-batch means (sequences {lo}-{hi})" in f1.detail
  assert "sequence count" in f1.fix and "weight=n_sequences" in f1.fix
  assert "token" not in f1.fix


def test_a_per_sequence_average_with_token_weights_names_the_proportion():
  """No usual count gives the sequence shares: the audit says so, with the
  counts it tried and the proportion it found, and does not claim F10."""
  report = _audit(PER_SEQUENCE_BY_TOKENS)
  assert report.found() == {"weight"}, str(report)
  assert report.whole_batch_weighting == "fitted"
  np.testing.assert_allclose(
    report.whole_batch_weights, SEQUENCES / SEQUENCES.sum(), rtol=1e-4
  )
  detail = report.verdicts["weight"].detail
  assert f"in proportion to {[int(n) for n in SEQUENCES]}: none of their" in detail
  assert "rows [4, 4, 4, 4], positions [32, 32, 32, 32] or 1 each" in detail
  assert "F10" not in report.verdicts


def test_a_mean_over_all_positions_with_token_weights_names_positions():
  report = _audit(position_mean)
  assert report.found() == {"weight"}, str(report)
  fix = report.verdicts["weight"].fix
  assert "weight=n_rows" in fix and "position count" in fix
  np.testing.assert_allclose(report.whole_batch_weights, ROWS / ROWS.sum())


# --- a summed loss: grad_reduction="window_mean" ----------------------------------


def test_the_window_mean_port_of_a_summed_loss_is_audited():
  """It was refused ("audit's loss_fn returns a token mean")."""
  port = optax_accum.MultiSteps(ADAM, K, grad_reduction="window_mean")
  report = _audit(summed, port)
  assert report.ok, str(report)
  assert "grad_reduction='window_mean'" in report.setup
  assert report.whole_batch_weighting == "sum" and report.as_declared
  assert "as grad_reduction='window_mean' does" in report.verdicts["weight"].detail
  np.testing.assert_array_equal(report.whole_batch_weights, np.ones(K))


def test_a_summed_loss_given_token_weights_needs_window_mean():
  report = _audit(summed)
  assert report.found() == {"weight"}, str(report)
  weight = report.verdicts["weight"]
  assert weight.detail.startswith(
    "the whole batch sums the micro-batches' gradients as they are (1 each)"
  )
  assert "grad_reduction='window_mean'" in weight.fix


def test_a_token_mean_under_window_mean_needs_grad_reduction_mean():
  port = optax_accum.MultiSteps(ADAM, K, grad_reduction="window_mean")
  report = _audit(token_mean, port)
  assert report.found() == {"weight"}, str(report)
  weight = report.verdicts["weight"]
  assert "grad_reduction='window_mean' sums them as they are" in weight.detail
  assert "grad_reduction='mean'" in weight.fix and "weight=n_tokens" in weight.fix


@functools.cache
def dropping_summed_loop(optimizer, k):
  """A trainer for a summed loss: sums its micro-batches' gradients as they
  are, and from update 4 on leaves micro-batch 1 out (its counters live in the
  state, so the audit's restart keeps them)."""
  grad = jax.jit(jax.grad(summed, has_aux=True))

  @jax.jit
  def apply(params, opt_state, acc):
    updates, opt_state = optimizer.update(acc, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return optimizer.init(params), zeros, jnp.int32(0), jnp.int32(0)

  def step(params, state, micro_batch):
    opt_state, acc, i, updates = state
    g, _ = grad(params, micro_batch)
    if not (int(i) == 0 and int(updates) >= 3):
      acc = jax.tree.map(jnp.add, acc, g)
    if int(i) + 1 < k:
      return params, (opt_state, acc, i + 1, updates)
    params, opt_state = apply(params, opt_state, acc)
    zeros = jax.tree.map(jnp.zeros_like, acc)
    return params, (opt_state, zeros, jnp.int32(0), updates + 1)

  return init, step


def test_a_summed_loss_trainer_that_drops_a_micro_batch_is_caught():
  """Issue 69: with the token weighting as its rounding floor (1.3e-2) a
  micro-batch dropped from update 4 on (1e-2 off) passed; the floor is now the
  sum the loss needs, rounding alone."""
  report = _audit(summed, accumulation=dropping_summed_loop)
  assert report.found() == {"other"}, str(report)
  assert report.whole_batch_weighting == "sum"
  assert report.verdicts["weight"].status == "ok"  # It sums, as the loss needs.
  other = report.verdicts["other"]
  assert "off after update 4" in other.detail
  assert "updates 1-3 match" in other.fix
  assert report.params_diff > 1e-3 and report.rounding_diff < 1e-6


# --- what stays: a loss that couples rows, and clear errors -----------------------


def coupled_loss(params, batch):
  """The token mean plus a balance of the batch's mean prediction: no sum
  over rows, so no weighting of the micro-batches gives the whole batch."""
  ce, tokens = token_mean(params, batch)
  logits = jnp.tanh(params["embed"][batch["inputs"]]) @ params["head"]
  mask = jnp.asarray(batch["mask"], logits.dtype)[..., None]
  mean_p = (jax.nn.softmax(logits) * mask).sum((0, 1)) / jnp.maximum(tokens, 1)
  return ce + V * jnp.sum(mean_p**2), tokens


def test_a_loss_that_couples_rows_stays_f10():
  report = _audit(coupled_loss)
  assert report.found() == {"F10"}, str(report)
  assert "weight" not in report.verdicts
  assert "no weight reproduces it" in report.verdicts["F10"].detail
  assert report.whole_batch_weighting == "coupled"


def test_an_accumulator_with_accumulation_is_still_refused():
  port = optax_accum.MultiSteps(ADAM, K, grad_reduction="window_mean")
  with pytest.raises(ValueError, match=r"`optimizer` is an accumulator .* and "):
    _audit(summed, port, accumulation=dropping_summed_loop)


# --- per_window: the order of a window's micro-batches ----------------------------


def test_per_window_hands_the_micro_batches_strided():
  """Micro-batch i of a window holds rows i, i + k, i + 2k, ... (the default
  split), in order; a `split=` of contiguous rows hands those instead."""
  seen = []

  def loss_fn(params, batch):
    return jnp.mean((batch["x"] * params) ** 2), jnp.float32(batch["x"].shape[0])

  def recording(optimizer, k):
    def train_window(params, state, micro_batches):
      seen.append([np.asarray(b["row"]).tolist() for b in micro_batches])
      grads = [jax.grad(loss_fn, has_aux=True)(params, b)[0] for b in micro_batches]
      updates, state = optimizer.update(sum(grads) / k, state, params)
      return optax.apply_updates(params, updates), state

    return optimizer.init, train_window

  batch = {"x": np.linspace(0.5, 2.0, 8, dtype=np.float32), "row": np.arange(8)}
  setup = optax_accum.per_window(recording)
  assert optax_accum.audit(
    loss_fn, optax.sgd(0.1), jnp.ones(()), batch, k=2, steps=1, accumulation=setup
  ).ok
  assert seen[0] == [[0, 2, 4, 6], [1, 3, 5, 7]]
  seen.clear()

  def contiguous(batch, k):
    n = len(batch["row"]) // k
    return [
      {name: v[i * n : (i + 1) * n] for name, v in batch.items()} for i in range(k)
    ]

  optax_accum.audit(
    loss_fn,
    optax.sgd(0.1),
    jnp.ones(()),
    batch,
    k=2,
    steps=1,
    accumulation=setup,
    split=contiguous,
  )
  assert seen[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_another_weighting_shows_both_and_names_weight_and_grad_reduction():
  """A window trainer that weighs its micro-batches 1, 2, 3, 4: `other`
  prints its weighting beside the whole batch's (token shares), and its fix
  names the weight and `grad_reduction`."""

  def fixed_shares(optimizer, k):
    grad = jax.grad(token_mean, has_aux=True)

    @jax.jit
    def train_window(params, state, micro_batches):
      grads = [grad(params, b)[0] for b in micro_batches]
      mean = jax.tree.map(
        lambda *g: sum((i + 1) * x for i, x in enumerate(g)) / 10, *grads
      )
      updates, state = optimizer.update(mean, state, params)
      return optax.apply_updates(params, updates), state

    return optimizer.init, train_window

  report = _audit(token_mean, accumulation=optax_accum.per_window(fixed_shares))
  assert report.found() == {"other"}, str(report)
  shares = ", ".join(f"{x:.3g}" for x in TOKENS / TOKENS.sum())
  other = report.verdicts["other"]
  assert (
    f"it weighs the micro-batches [0.1, 0.2, 0.3, 0.4], the whole batch [{shares}]"
    in other.detail
  )
  assert "weight=n_tokens" in other.fix and "grad_reduction='mean'" in other.fix

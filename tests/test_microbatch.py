"""`weighted_mean_accumulator` under `optax.microbatch` equals the whole batch.

The micro-batches hold very different token counts, one of them none (its
token-mean loss is 0/0 = NaN): where optax's own MEAN accumulator computes the
mean of means (F1), the weighted one computes the whole batch's token mean.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum
from optax_accum._core import _checks

MEAN = optax.microbatching.AccumulationType.MEAN
K = 4  # micro-batches of 2 rows: micro-batch i holds rows i and i + 4
# Tokens per micro-batch: 12 + 11, 1 + 0, 0 + 0, 6 + 3.
LENGTHS = (12, 1, 0, 6, 11, 0, 0, 3)
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _batch(seed=1, lengths=LENGTHS):
  batch = toy_lm.make_batch(seed=seed, batch=len(lengths))
  seq_len = batch["mask"].shape[1]
  batch["mask"] = np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]
  return batch


def _guarded_mean_loss(params, batch):
  """The token mean with 0/0 guarded: a micro-batch without tokens gives 0."""
  losses, mask = toy_lm.token_losses(params, batch)
  weight = mask.sum()
  return losses.sum() / jnp.maximum(weight, 1.0), weight


def _loss_and_grads(loss_fn, params, batch):
  """``((loss, grads), tokens)``: what the accumulator takes."""
  (loss, tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  return (loss, grads), tokens


@functools.cache  # Accumulators compare equal by their functions: compiled once.
def _microbatched(accumulator, loss_fn=toy_lm.mean_loss, jit=True):
  fun = optax.microbatch(
    functools.partial(_loss_and_grads, loss_fn),
    argnums=1,
    microbatch_size=len(LENGTHS) // K,
    accumulator=accumulator,
  )
  return jax.jit(fun) if jit else fun


_whole = jax.jit(functools.partial(_loss_and_grads, toy_lm.mean_loss))


def test_the_batch_splits_as_described():
  """The setup the other tests rely on: one micro-batch without tokens, whose
  naive token mean is NaN, beside micro-batches of 23, 1 and 9 tokens."""
  micro = optax.microbatching.reshape_batch_axis(_batch(), len(LENGTHS) // K)
  tokens = micro["mask"].sum(axis=(1, 2))
  np.testing.assert_array_equal(tokens, [23, 1, 0, 9])
  empty = jax.tree.map(lambda x: x[2], micro)
  (loss, _), _ = _whole(toy_lm.init_params(), empty)
  assert np.isnan(float(loss))


@JIT
def test_gradient_and_loss_equal_the_whole_batch(jit):
  params, batch = toy_lm.init_params(), _batch()
  accumulator = optax_accum.weighted_mean_accumulator()
  (loss, grads), tokens = _microbatched(accumulator, jit=jit)(params, batch)
  (whole_loss, whole_grads), whole_tokens = _whole(params, batch)

  assert toy_lm.rel_error(grads, whole_grads) <= 1e-5
  assert abs(float(loss) - float(whole_loss)) <= 1e-5 * abs(float(whole_loss))
  assert tokens.dtype == whole_tokens.dtype
  assert int(tokens) == int(whole_tokens) == sum(LENGTHS)


def test_optax_mean_accumulator_is_the_mean_of_means():
  """optax's MEAN is far from the whole batch on the same micro-batches, even
  with 0/0 guarded (unguarded, its loss is NaN); the weighted mean is within
  1e-5."""
  params, batch = toy_lm.init_params(), _batch()
  (_, whole), _ = _whole(params, batch)
  weighted = optax_accum.weighted_mean_accumulator()
  (_, weighted_grads), _ = _microbatched(weighted, _guarded_mean_loss)(params, batch)
  (_, mean_grads), _ = _microbatched((MEAN, MEAN), _guarded_mean_loss)(params, batch)
  (naive_loss, _), _ = _microbatched((MEAN, MEAN))(params, batch)

  weighted_err = toy_lm.rel_error(weighted_grads, whole)
  mean_err = toy_lm.rel_error(mean_grads, whole)
  assert weighted_err <= 1e-5, weighted_err
  assert mean_err > 1e-1, mean_err
  assert np.isnan(float(naive_loss))


def test_adamw_updates_equal_the_whole_batch():
  """Three AdamW updates: params within 1e-5 of the whole batch's (relative
  to each leaf's largest), where optax's MEAN is off by more than 1e-2.
  Params, not the moves: Adam scales a gradient that is rounding noise on
  both sides to a full step (issue 27, item 5)."""
  adamw = optax.adamw(1e-2, weight_decay=0.1)
  weighted = _microbatched(optax_accum.weighted_mean_accumulator())
  mean = _microbatched((MEAN, MEAN), _guarded_mean_loss)

  def run(loss_and_grads):
    @jax.jit
    def step(params, state, batch):
      (_, grads), _ = loss_and_grads(params, batch)
      updates, state = adamw.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params = toy_lm.init_params()
    state = adamw.init(params)
    for seed in range(3):
      params, state = step(params, state, _batch(seed=10 + seed))
    return params

  whole = run(_whole)
  assert toy_lm.rel_error(toy_lm.init_params(), whole) > 1e-2  # params moved
  assert toy_lm.max_rel_diff(run(weighted), whole) <= 1e-5
  assert toy_lm.max_rel_diff(run(mean), whole) > 1e-2


def test_float64_is_exact_to_machine_precision():
  with jax.enable_x64(True):
    params, batch = toy_lm.init_params(dtype=jnp.float64), _batch()
    accumulator = optax_accum.weighted_mean_accumulator()
    (_, grads), _ = _microbatched(accumulator)(params, batch)
    (_, whole), _ = _whole(params, batch)
    assert jax.tree.leaves(grads)[0].dtype == jnp.float64
    assert toy_lm.rel_error(grads, whole) <= 1e-12


@JIT
def test_all_zero_batch_gives_zeros_and_zero_weight(jit):
  """Policy: total weight 0 gives exact zeros, never NaN; the caller skips
  the update on ``tokens == 0``."""
  params, batch = toy_lm.init_params(), _batch(lengths=(0,) * 8)
  accumulator = optax_accum.weighted_mean_accumulator()
  (loss, grads), tokens = _microbatched(accumulator, jit=jit)(params, batch)
  assert float(tokens) == 0.0
  assert float(loss) == 0.0
  for leaf in jax.tree.leaves(grads):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


def _pairs(values, weights, *, jit=True):
  """``optax.microbatch`` over rows that are already ``(value, weight)``."""
  fun = optax.microbatch(
    lambda v, w: (jax.tree.map(lambda x: x[0], v), w[0]),
    argnums=(0, 1),
    microbatch_size=1,
    accumulator=optax_accum.weighted_mean_accumulator(),
  )
  return (jax.jit(fun) if jit else fun)(values, jnp.asarray(weights))


@JIT
def test_bad_weights_and_zero_weight_nan_values_add_nothing(jit):
  """Weight 0 with a NaN value, NaN and inf weights: dropped, as in
  MultiSteps. A NaN value with positive weight spoils the mean, as it would
  spoil the whole batch."""
  values = jnp.array([2.0, jnp.nan, 60.0, 70.0, 4.0])
  weights = [1.0, 0.0, jnp.nan, jnp.inf, 3.0]
  mean, total = _pairs(values, weights, jit=jit)
  assert (float(mean), float(total)) == (3.5, 4.0)

  mean, total = _pairs(values.at[0].set(jnp.nan), weights, jit=jit)
  assert np.isnan(float(mean)) and float(total) == 4.0


def test_pytree_values_keep_structure_and_dtype():
  """A dict of bfloat16 and float32 leaves comes back as it went in, summed
  in float32: 256 micro-batches of a bfloat16 256 then 1s average to ~2, where
  a bfloat16 sum stalls at 256 (256 + 1 rounds back to 256) and gives 1.
  Integer weights, under strict dtype promotion."""
  n = 256
  ones = jnp.ones(n).at[0].set(256.0)
  values = {"bf16": ones.astype(jnp.bfloat16), "nested": {"f32": ones[:, None]}}
  with jax.numpy_dtype_promotion("strict"):
    mean, total = _pairs(values, jnp.ones(n, jnp.int32))

  assert jax.tree.structure(mean) == jax.tree.structure(values)
  assert mean["bf16"].dtype == jnp.bfloat16 and mean["nested"]["f32"].shape == (1,)
  assert total.dtype == jnp.int32 and int(total) == n
  expected = (256.0 + n - 1) / n
  assert float(mean["bf16"]) == float(jnp.bfloat16(expected))
  assert float(mean["bf16"]) != 1.0
  np.testing.assert_allclose(mean["nested"]["f32"], [expected], rtol=1e-6)


def test_micro_vmap_weights_each_row():
  """``aggregate``: ``micro_vmap`` with a weight per row equals the weighted
  mean over all rows, whatever the micro-batch size."""
  rng = np.random.default_rng(0)
  values = rng.normal(size=(12, 3)).astype(np.float32)
  weights = rng.integers(0, 5, size=12).astype(np.float32)
  expected = (weights[:, None] * values).sum(0) / weights.sum()
  for size in (1, 4, 12):
    mean, total = optax.microbatching.micro_vmap(
      lambda v, w: (v, w),
      in_axes=(0, 0),
      microbatch_size=size,
      accumulator=optax_accum.weighted_mean_accumulator(),
    )(values, weights)
    np.testing.assert_allclose(mean, expected, rtol=1e-6)
    assert float(total) == weights.sum()


def test_prefix_tree_with_optax_accumulators():
  """Integer outputs ride beside the pair with an accumulator of their own."""
  fun = optax.microbatch(
    lambda x, w: ((x.mean(), w.sum()), jnp.int32(x.shape[0])),
    argnums=(0, 1),
    microbatch_size=2,
    accumulator=(
      optax_accum.weighted_mean_accumulator(),
      optax.microbatching.AccumulationType.SUM,
    ),
  )
  (mean, total), rows = fun(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([2.0] * 4))
  assert (float(mean), float(total), int(rows)) == (2.5, 8.0, 4)


@pytest.mark.parametrize(
  ("fun", "message"),
  [
    (lambda x: x.mean(), r"must return \(value, weight\)"),
    (lambda x: (x.mean(), x.sum(), x.sum()), r"must return \(value, weight\)"),
    (lambda x: (x.mean(), x), r"`weight` must be a scalar"),
    (lambda x: (x.mean(), x.sum() > 0), r"`weight` must be a real number"),
    (lambda x: ({"n": jnp.int32(1)}, x.sum()), r"value leaf \['n'\] has dtype int32"),
  ],
)
def test_bad_outputs_raise_at_trace_time(fun, message):
  microbatched = optax.microbatch(
    fun, 0, 2, accumulator=optax_accum.weighted_mean_accumulator()
  )
  with pytest.raises(ValueError, match=message):
    microbatched(jnp.ones(4))


def _scalar_loss(params, x):
  return jnp.mean((jax.tree.leaves(params)[0].sum() * x - 3.0) ** 2)


@pytest.mark.parametrize(
  ("params", "got"),
  [
    ({"w": jnp.ones(3)}, r"got a tree with leaves \['w'\] \(3,\)"),
    (jnp.ones(3), r"got shape \(3,\)"),
  ],
  ids=["dict", "array"],
)
def test_value_and_grad_output_without_weight_is_refused_up_front(params, got):
  """Issue 43, item 4: ``jax.value_and_grad`` output, ``(loss, grads)``, has
  no weight. Refused when traced, with what was found and the shape expected
  (before: ``AttributeError: 'dict' object has no attribute 'dtype'``, or a
  message that did not say what to return)."""
  microbatched = optax.microbatch(
    jax.value_and_grad(_scalar_loss),
    argnums=1,
    microbatch_size=2,
    accumulator=optax_accum.weighted_mean_accumulator(),
  )
  with pytest.raises(ValueError, match=got + r".*return \(\(loss, grads\), weight\)"):
    jax.eval_shape(microbatched, params, jnp.arange(4.0))


@JIT
def test_a_scalar_params_gradient_as_weight_is_not_silent(jit):
  """Issue 43, item 4: for one scalar param, ``(loss, grad)`` has the shape of
  ``(value, weight)``. Its gradient is negative here, so every micro-batch
  was dropped and the result was (0.0, 0.0), where the whole batch gives
  (5.175, -10.5): a negative weight now makes the result NaN."""
  fun = jax.value_and_grad(_scalar_loss)
  microbatched = optax.microbatch(
    fun, 1, 2, accumulator=optax_accum.weighted_mean_accumulator()
  )
  x = jnp.arange(1.0, 5.0)
  whole_loss, whole_grad = fun(jnp.float32(0.3), x)
  assert float(whole_grad) < 0 < float(whole_loss)
  loss, weight = (jax.jit(microbatched) if jit else microbatched)(jnp.float32(0.3), x)
  assert np.isnan(float(loss)) and np.isnan(float(weight))


def test_a_negative_weight_makes_the_mean_nan():
  """One negative weight among good ones: the mean is NaN (no count is
  negative), where an integer weight keeps the kept micro-batches' total."""
  mean, total = _pairs(jnp.array([2.0, 4.0, 8.0]), [1.0, -1.0, 3.0])
  assert np.isnan(float(mean)) and np.isnan(float(total))
  mean, total = _pairs(jnp.array([2.0, 4.0, 8.0]), jnp.array([1, -1, 3], jnp.int32))
  assert np.isnan(float(mean)) and total.dtype == jnp.int32 and int(total) == 4


# -- what a loss_fn returned, in words (issue 43, item 8) -----------------------


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_a_loss_fn_returning_a_scalar_is_told_to_return_loss_and_weight(mode):
  """A bare scalar loss was reported as "got LinearizeTracer" (the tracer the
  gradient sees); the message now says a scalar came back."""
  opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  step = optax_accum.make_train_step(lambda p, b: (b @ p["w"]).mean(), opt, mode=mode)
  params = {"w": jnp.ones(3)}
  batch = jnp.ones((2, 4, 3)) if mode == "scan" else jnp.ones((4, 3))
  with pytest.raises(
    ValueError,
    match=r"`loss_fn` must return \(loss, weight\) with has_aux=False, "
    r"got a scalar \(float32\[\]\)\.",
  ):
    step(params, opt.init(params), batch)


def test_a_tracer_is_described_by_its_shape_and_dtype():
  """The helper the message comes from, given what ``jax.value_and_grad``
  hands it."""
  seen = []
  jax.value_and_grad(lambda x: seen.append(_checks.describe_output(x)) or x.sum())(
    jnp.ones(3)
  )
  assert seen == ["an array (float32[3])"]

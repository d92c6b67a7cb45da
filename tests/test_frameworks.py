"""Issue 18: the loops Flax Linen, Flax NNX and Equinox users write, each equal
to whole-batch training (AdamW, several updates, float32, within 1e-5).

One test (or a few) per item of the issue; the item number is in the name's
docstring. Equinox tests are skipped without equinox (an optional test extra).
"""

import functools
import inspect
import json
import pathlib
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from flax_models import (
  CLASSES,
  FEATURES,
  HIDDEN,
  MLP,
  K,
  linen_mlp,
  make_batches,
  micro_batches,
  rel,
  summed_ce,
  token_mean_ce,
)

import optax_accum
import optax_accum.flax

UPDATES = 5
ROOT = pathlib.Path(__file__).parent.parent


def _adamw():
  return optax.adamw(1e-2, weight_decay=0.1)


def _whole_batch(loss_fn, params, tx, batches, pass_value=False):
  """Plain whole-batch training: one update per batch. Returns the params, the
  optimizer state and the loss of each batch (at the params it was used with).
  """

  @jax.jit
  def step(params, state, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    extra = {"value": loss} if pass_value else {}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state, loss

  state, losses = tx.init(params), []
  for batch in batches:
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  return params, state, losses


@functools.partial(jax.jit, static_argnums=0)
def _linen_micro_step(loss_fn, state, micro_batch):
  """The plain Linen loop body, jitted as a user would (eagerly, each call
  compiles MultiSteps' `lax.cond` again)."""
  grads, n = jax.grad(loss_fn, has_aux=True)(state.params, micro_batch)
  return state.apply_gradients(grads=grads, weight=n)


# --- Models -------------------------------------------------------------------------


def _nnx_whole_batch(tx, batches, loss=token_mean_ce, pass_value=False):
  graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, batch):
    return loss(nnx.merge(graphdef, params)(batch["x"]), batch)

  return _whole_batch(loss_fn, params, tx, batches, pass_value)


@functools.cache
def _adamw_reference(model):
  """Whole-batch AdamW on ``make_batches(UPDATES)`` for the Linen or NNX MLP:
  params, state and losses, computed once for the tests that compare with it."""
  batches = make_batches(UPDATES)
  if model == "nnx":
    return _nnx_whole_batch(_adamw(), batches)
  _, params, loss_fn = linen_mlp()
  return _whole_batch(loss_fn, params, _adamw(), batches)


# --- 1. Linen TrainState -----------------------------------------------------------


def test_linen_train_state_apply_gradients_takes_weight():
  """Item 1 (and 7): the standard Linen loop, with `weight=` and an update count."""
  model, params, loss_fn = linen_mlp()
  batches = make_batches(UPDATES)
  whole, _, _ = _adamw_reference("linen")

  state = optax_accum.flax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.MultiSteps(_adamw(), K)
  )

  @jax.jit
  def train_step(state, batch):
    def loss(params):
      return token_mean_ce(state.apply_fn({"params": params}, batch["x"]), batch)

    grads, n = jax.grad(loss, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, weight=n)

  for batch in batches:
    for micro_batch in micro_batches(batch):
      state = train_step(state, micro_batch)
  assert rel(state.params, whole) <= 1e-5
  assert int(state.step) == UPDATES  # Updates, not K * UPDATES micro-batches.

  # Control: Linen's own TrainState has no way to pass the weight, and gives
  # the uniform mean of micro-batch means (what the docs warn about).
  linen = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.MultiSteps(_adamw(), K)
  )

  @jax.jit
  def linen_step(linen, micro_batch):
    grads, _ = jax.grad(loss_fn, has_aux=True)(linen.params, micro_batch)
    return linen.apply_gradients(grads=grads)

  # Issue 49, item 3: not silent; the warning names the fix.
  fix = r"no `weight=`.*use optax_accum.flax.TrainState"
  with pytest.warns(UserWarning, match=fix):
    for batch in batches:
      for micro_batch in micro_batches(batch):
        linen = linen_step(linen, micro_batch)
  assert rel(linen.params, whole) > 1e-3
  assert int(linen.step) == K * UPDATES


def test_linen_train_state_refuses_what_would_be_silently_wrong():
  """Item 1: no weight, or an accumulator that ignores it, is an error."""
  model, params, loss_fn = linen_mlp()
  grads, _ = jax.grad(loss_fn, has_aux=True)(params, make_batches(1)[0])
  state = optax_accum.flax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.MultiSteps(_adamw(), K)
  )
  with pytest.raises(
    ValueError,
    match=r"needs `weight=`: the count.*divides by.*per-row means.*window_mean",
  ):
    state.apply_gradients(grads=grads)
  state.apply_gradients(grads=grads, weight=1)  # The uniform mean, asked for.
  optax_state = optax_accum.flax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.MultiSteps(_adamw(), K)
  )
  with pytest.raises(ValueError, match=r"optax.MultiSteps, which ignores `weight`"):
    optax_state.apply_gradients(grads=grads, weight=3)
  # Issue 69, item 3: a plain optimizer (k = 1) is Linen's own TrainState;
  # tests/test_flax.py checks it bit for bit.
  plain = optax_accum.flax.TrainState.create(
    apply_fn=model.apply, params=params, tx=_adamw()
  )
  linen = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=_adamw()
  )
  got, want = (
    plain.apply_gradients(grads=grads, weight=3),
    linen.apply_gradients(grads=grads),
  )
  assert rel(got.params, want.params) == 0.0 and int(got.step) == 1


def test_linen_section_opens_with_the_fix_and_flax_s_own_type_error():
  """Issue 69, item 4: swapping only MultiSteps and passing `weight=` to Linen's
  own TrainState fails with Flax's bare TypeError, which cannot name the fix.
  The Linen section says "use optax_accum.flax.TrainState" before its code,
  with the TypeError's text as Flax writes it, so a search for it lands there;
  so does the migration notebook."""
  model, params, loss_fn = linen_mlp()
  grads, _ = jax.grad(loss_fn, has_aux=True)(params, make_batches(1)[0])
  linen = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.MultiSteps(_adamw(), K)
  )
  with warnings.catch_warnings(), pytest.raises(TypeError) as raised:
    warnings.simplefilter("ignore")  # The no-weight warning (tested above).
    linen.apply_gradients(grads=grads, weight=3)
  error = f"TypeError: {raised.value}"
  assert "unexpected keyword argument 'weight'" in error
  page = (ROOT / "docs" / "frameworks.md").read_text()
  linen_section = page.split("\n## Flax Linen", 1)[1].split("\n## ", 1)[0]
  before_code = re.sub(r"\s+", " ", linen_section.split("```", 1)[0])
  assert "use `optax_accum.flax.TrainState`" in before_code
  assert f"`{error}`" in before_code
  notebook = json.loads((ROOT / "notebooks" / "05_migrating.ipynb").read_text())
  cells = [
    re.sub(r"\s+", " ", "".join(cell["source"]))
    for cell in notebook["cells"]
    if cell["cell_type"] == "markdown"
  ]
  assert any(
    f"`{error}`" in cell and "optax_accum.flax.TrainState" in cell for cell in cells
  )


class _DropoutDense(nn.Module):
  @nn.compact
  def __call__(self, x, *, train):
    return nn.Dropout(0.5, deterministic=not train)(nn.Dense(16)(x))


@pytest.mark.parametrize("counter", ["micro_step", "step"])
def test_linen_dropout_keys_from_micro_step_differ_within_a_window(counter):
  """Issue 49, item 2: Flax's idiom `fold_in(dropout_rng, state.step)` gave
  every micro-batch of a window the same key (`step` counts updates), so
  same-shaped micro-batches drew the same masks; `micro_step` counts calls."""
  model, x = _DropoutDense(), jnp.ones((4, 8))
  params = model.init(jax.random.key(0), x, train=False)["params"]
  state = optax_accum.flax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.MultiSteps(optax.sgd(0.0), K)
  )
  dropout_rng = jax.random.key(1)

  @jax.jit
  def train_step(state, x):
    key = jax.random.fold_in(dropout_rng, getattr(state, counter))

    def loss(params):
      out = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": key})
      return (out**2).mean(), out != 0

    grads, mask = jax.grad(loss, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, weight=x.shape[0]), mask

  masks = []
  for _ in range(2 * K):
    state, mask = train_step(state, x)
    masks.append(np.asarray(mask))
  distinct = {m.tobytes() for m in masks}
  assert int(state.step) == 2 and int(state.micro_step) == 2 * K
  assert len(distinct) == (2 * K if counter == "micro_step" else 2)


def test_nnx_optimizer_micro_step_counts_calls():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(
    model, optax_accum.MultiSteps(optax.sgd(0.1), K), wrt=nnx.Param
  )
  for call in range(K + 1):
    assert int(optimizer.micro_step) == call
    grads = nnx.grad(lambda m: (m(jnp.ones((3, 2))) ** 2).mean())(model)
    optimizer.update(model, grads, weight=3)
  assert int(optimizer.step) == 1


# --- 2. The window's loss after the update (NNX, nnx.Optimizer) --------------------


def test_nnx_optimizer_loop_reads_the_finished_windows_loss():
  """Item 2: after the update, the window's loss and weight are still there."""
  batches = make_batches(UPDATES)
  whole, _, whole_losses = _adamw_reference("nnx")

  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax_accum.MultiSteps(_adamw(), K), wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, batch):
    def loss_fn(model):
      return token_mean_ce(model(batch["x"]), batch)

    (loss, n), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, weight=n, loss=loss)

  for batch, whole_loss in zip(batches, whole_losses, strict=True):
    for micro_batch in micro_batches(batch):
      micro_step(model, optimizer, micro_batch)
    window = optax_accum.get_last_window(optimizer.opt_state)
    np.testing.assert_allclose(float(window["loss"]), whole_loss, rtol=1e-5)
    assert float(window["weight"]) == batch["mask"].sum()
    assert float(optimizer.opt_state.acc_weight[...]) == 0  # Reset, as before.
  assert rel(nnx.state(model, nnx.Param), whole) <= 1e-5


# --- 3. reduce_on_plateau gets the window's loss (Equinox) -------------------------


def _equinox():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(
    FEATURES, CLASSES, HIDDEN, depth=1, activation=jax.nn.tanh, key=jax.random.key(0)
  )

  def loss_fn(model, batch, loss=token_mean_ce):
    return loss(jax.vmap(jax.vmap(model))(batch["x"]), batch)

  return eqx, model, loss_fn


def test_equinox_loop_feeds_reduce_on_plateau_the_window_loss():
  """Item 3: `update(..., loss=l)` gives reduce_on_plateau the window's loss."""
  eqx, model, loss_fn = _equinox()
  # rtol=0.5: no window improves enough, so the learning rate halves often.
  plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.5)
  tx = optax.chain(_adamw(), plateau)
  params, static = eqx.partition(model, eqx.is_inexact_array)
  batches = make_batches(UPDATES)
  whole, whole_state, _ = _whole_batch(
    lambda p, b: loss_fn(eqx.combine(p, static), b), params, tx, batches, True
  )

  opt = optax_accum.MultiSteps(tx, K)
  state = opt.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def micro_step(model, state, batch):
    (loss, n), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = opt.update(grads, state, params, weight=n, loss=loss)
    return eqx.apply_updates(model, updates), state

  for batch in batches:
    for micro_batch in micro_batches(batch):
      model, state = micro_step(model, state, micro_batch)
  ours, theirs = state.inner_opt_state[1], whole_state[1]
  assert float(theirs.scale) < 0.5  # The plateau logic did act.
  assert float(ours.scale) == float(theirs.scale)
  np.testing.assert_allclose(ours.best_value, theirs.best_value, rtol=1e-5)
  assert rel(eqx.filter(model, eqx.is_inexact_array), whole) <= 1e-5


# --- 4. multi_transform learning rates, every group (Linen) ------------------------


def test_linen_multi_transform_reports_every_groups_learning_rate():
  """Item 4: two injected groups, both learning rates by label."""
  model, params, loss_fn = linen_mlp()
  body_lr = optax.linear_schedule(1e-2, 1e-3, UPDATES)

  def tx():
    return optax.multi_transform(
      {
        "body": optax.inject_hyperparams(optax.adamw)(body_lr, weight_decay=0.1),
        "head": optax.inject_hyperparams(optax.adamw)(3e-3, weight_decay=0.1),
      },
      {"Dense_0": "body", "Dense_1": "head"},
    )

  batches = make_batches(UPDATES)
  whole, _, _ = _whole_batch(loss_fn, params, tx(), batches)
  state = optax_accum.flax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.MultiSteps(tx(), K)
  )
  for update, batch in enumerate(batches):
    for micro_batch in micro_batches(batch):
      state = _linen_micro_step(loss_fn, state, micro_batch)
    learning_rate = optax_accum.get_hyperparams(state.opt_state)["learning_rate"]
    assert list(learning_rate) == ["body", "head"]
    np.testing.assert_allclose(learning_rate["body"], body_lr(update), rtol=1e-6)
    np.testing.assert_allclose(learning_rate["head"], 3e-3, rtol=1e-6)
  assert rel(state.params, whole) <= 1e-5

  # The ready-made step's metrics say the same.
  opt = optax_accum.MultiSteps(tx(), K)
  step = optax_accum.make_train_step(loss_fn, opt, mode="scan")
  _, _, metrics = step(
    params, opt.init(params), optax_accum.split_micro_batches(batches[0], K)
  )
  assert set(metrics["learning_rate"]) == {"body", "head"}


# --- 5. Hugging Face-style losses (NNX) --------------------------------------------


def test_hugging_face_style_losses_with_window_mean():
  """Item 5: losses summed and divided by the window's known token total."""
  batches = make_batches(UPDATES)
  whole, _, whole_losses = _adamw_reference("nnx")

  model = MLP(nnx.Rngs(0))
  opt = optax_accum.MultiSteps(_adamw(), K, grad_reduction="window_mean")
  optimizer = optax_accum.flax.Optimizer(model, opt, wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, batch, num_items_in_batch):
    def loss_fn(model):
      total, n = summed_ce(model(batch["x"]), batch)
      return total / num_items_in_batch, n

    (loss, n), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, weight=n, loss=loss)

  for batch, whole_loss in zip(batches, whole_losses, strict=True):
    num_items_in_batch = batch["mask"].sum()  # Known before the window starts.
    for micro_batch in micro_batches(batch):
      micro_step(model, optimizer, micro_batch, num_items_in_batch)
    window = optax_accum.get_last_window(optimizer.opt_state)
    np.testing.assert_allclose(float(window["loss"]), whole_loss, rtol=1e-5)
    assert float(window["weight"]) == num_items_in_batch
  assert rel(nnx.state(model, nnx.Param), whole) <= 1e-5


def test_hugging_face_style_metrics_in_the_train_step():
  """Item 5: the ready-made step's loss metric is the window's, not k times it."""
  model, params, _ = linen_mlp()
  batches = make_batches(UPDATES)
  whole, _, whole_losses = _adamw_reference("linen")

  def share_of_window_mean(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    total, n = summed_ce(logits, batch)
    return total / batch["num_items_in_batch"][0], n

  opt = optax_accum.MultiSteps(_adamw(), K, grad_reduction="window_mean")
  step = optax_accum.make_train_step(share_of_window_mean, opt)
  state = opt.init(params)
  for batch, whole_loss in zip(batches, whole_losses, strict=True):
    batch = {**batch, "num_items_in_batch": np.full(16, batch["mask"].sum())}
    for micro_batch in micro_batches(batch):
      params, state, metrics = step(params, state, micro_batch)
    np.testing.assert_allclose(float(metrics["loss"]), whole_loss, rtol=1e-5)
  assert rel(params, whole) <= 1e-5


# --- 7. Step counts updates (NNX) --------------------------------------------------


def test_nnx_step_counts_updates():
  """Item 7: `optax_accum.flax.Optimizer.step` counts updates; nnx's counts calls."""
  batches = make_batches(UPDATES)
  whole, _, _ = _adamw_reference("nnx")

  def run(optimizer_type):
    model = MLP(nnx.Rngs(0))
    optimizer = optimizer_type(
      model, optax_accum.MultiSteps(_adamw(), K), wrt=nnx.Param
    )

    @nnx.jit
    def micro_step(model, optimizer, batch):
      grads, n = nnx.grad(lambda m: token_mean_ce(m(batch["x"]), batch), has_aux=True)(
        model
      )
      optimizer.update(model, grads, weight=n)

    for batch in batches:
      for micro_batch in micro_batches(batch):
        micro_step(model, optimizer, micro_batch)
    return model, optimizer

  model, optimizer = run(optax_accum.flax.Optimizer)
  assert int(optimizer.step[...]) == UPDATES
  assert rel(nnx.state(model, nnx.Param), whole) <= 1e-5
  model, optimizer = run(nnx.Optimizer)
  assert int(optimizer.step[...]) == K * UPDATES  # What the docs warn about.
  assert int(optax_accum.get_update_count(optimizer.opt_state)) == UPDATES
  assert rel(nnx.state(model, nnx.Param), whole) <= 1e-5


def test_nnx_optimizer_refuses_a_missing_weight():
  model = MLP(nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(
    model, optax_accum.MultiSteps(_adamw(), K), wrt=nnx.Param
  )
  grads = nnx.grad(lambda m: m(jnp.ones((2, FEATURES))).sum())(model)
  with pytest.raises(ValueError, match=r"needs `weight=`"):
    optimizer.update(model, grads)
  with pytest.raises(ValueError, match=r"optax.MultiSteps, which ignores `weight`"):
    optax_accum.flax.Optimizer(model, optax.MultiSteps(_adamw(), K), wrt=nnx.Param)


# --- 8. make_train_step with a plain optax optimizer (Equinox) ---------------------


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_equinox_make_train_step_with_a_plain_optax_optimizer(mode):
  """Item 8: no MultiSteps with a meaningless k; streaming names its k."""
  eqx, model, loss_fn = _equinox()
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def params_loss(params, batch):
    return loss_fn(eqx.combine(params, static), batch)

  batches = make_batches(UPDATES)
  whole, _, _ = _whole_batch(params_loss, params, _adamw(), batches)

  if mode == "scan":
    step = optax_accum.make_train_step(params_loss, _adamw(), mode="scan")
  else:
    step = optax_accum.make_train_step(params_loss, _adamw(), every_k_schedule=K)
  state = step.init(params)
  for batch in batches:
    if mode == "scan":
      window = optax_accum.split_micro_batches(batch, K)
      params, state, metrics = step(params, state, window)
    else:
      for micro_batch in micro_batches(batch):
        params, state, metrics = step(params, state, micro_batch)
  assert int(metrics["update_count"]) == UPDATES
  model = eqx.combine(params, static)

  @eqx.filter_jit
  def evaluate(model, batch):
    return loss_fn(model, batch)[0]

  assert np.isfinite(float(evaluate(model, batches[0])))
  assert rel(params, whole) <= 1e-5


# --- 9. apply_if_finite and schedule-free inside MultiSteps ------------------------


def test_apply_if_finite_inside_multi_steps_counts_nothing_skipped_windows_does():
  """Item 9: the window with a NaN is dropped before apply_if_finite sees it."""
  batches = make_batches(UPDATES)
  poisoned = 2  # Window 2's first micro-batch has a NaN gradient.
  whole, _, _ = _nnx_whole_batch(
    _adamw(), [b for i, b in enumerate(batches) if i != poisoned]
  )
  model = MLP(nnx.Rngs(0))
  tx = optax.apply_if_finite(_adamw(), max_consecutive_errors=3)
  optimizer = optax_accum.flax.Optimizer(
    model, optax_accum.MultiSteps(tx, K), wrt=nnx.Param
  )

  @nnx.jit
  def micro_step(model, optimizer, batch, scale):
    def loss_fn(model):
      loss, n = token_mean_ce(model(batch["x"]), batch)
      return loss * scale, n

    grads, n = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, weight=n)

  for i, batch in enumerate(batches):
    for j, micro_batch in enumerate(micro_batches(batch)):
      scale = jnp.float32(np.nan if (i, j) == (poisoned, 0) else 1.0)
      micro_step(model, optimizer, micro_batch, scale)
  state = optimizer.opt_state
  assert int(state.skipped_windows[...]) == 1  # Monitor this ...
  assert int(state.inner_opt_state.total_notfinite[...]) == 0  # ... not this.
  assert int(optimizer.step[...]) == UPDATES - 1
  assert rel(nnx.state(model, nnx.Param), whole) <= 1e-5


def test_linen_schedule_free_eval_params_through_multi_steps():
  """Item 9: schedule_free_eval_params finds the state inside MultiSteps."""
  model, params, loss_fn = linen_mlp()
  batches = make_batches(UPDATES)
  tx = optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2, weight_decay=0.1)
  whole, whole_state, _ = _whole_batch(loss_fn, params, tx, batches)
  whole_eval = optax.contrib.schedule_free_eval_params(whole_state, whole)

  state = optax_accum.flax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.MultiSteps(tx, K)
  )
  for batch in batches:
    for micro_batch in micro_batches(batch):
      state = _linen_micro_step(loss_fn, state, micro_batch)
  eval_params = optax_accum.schedule_free_eval_params(state.opt_state, state.params)
  assert rel(eval_params, whole_eval) <= 1e-5
  assert rel(eval_params, state.params) > 1e-3  # Not the training params.
  with pytest.raises(ValueError, match="found 0"):
    optax_accum.schedule_free_eval_params(_adamw().init(params), params)


# --- 10. The documented step signature ---------------------------------------------


def test_documented_step_signatures_match_the_step():
  """Item 10: every `step(params, opt_state, batch...` in the docs is the real one."""
  documented = "params, opt_state, batch, rng=None, *, end_window=False"
  params = list(inspect.signature(optax_accum.TrainStep.__call__).parameters.values())
  real = [
    p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params[1:]
  ]
  keyword_only = [p.kind == p.KEYWORD_ONLY for p in params[1:]]
  real.insert(keyword_only.index(True), "*")
  assert ", ".join(real) == documented
  texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  texts.append(pathlib.Path(inspect.getsourcefile(optax_accum.make_train_step)))
  found = 0
  for path in texts:
    text = re.sub(r"\s*\n\s*", " ", path.read_text())
    for signature in re.findall(r"step\((params, opt_state, batch[^)]*)\)", text):
      assert signature == documented, f"{path.name}: step({signature})"
      found += 1
  assert found >= 2  # The README's and make_train_step's at least.


def test_pages_suggesting_plain_nnx_optimizer_say_its_step_counts_micro_batches():
  """Issue 43, item 10: a paragraph that suggests ``nnx.Optimizer(model,
  optax_accum.MultiSteps(...))`` says that its ``step`` then counts
  micro-batches, as docs/frameworks.md does (docs/recipes.md did not)."""
  found = 0
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    for paragraph in prose.split("\n\n"):
      flat = re.sub(r"\s+", " ", paragraph)
      if "nnx.Optimizer(model" in flat and "MultiSteps" in flat:
        found += 1
        assert re.search(r"step` (then )?counts (micro-batches|calls)", flat), (
          f"{path.name}: {flat}"
        )
  assert found >= 1

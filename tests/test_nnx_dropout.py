"""The NNX dropout recipe of docs/recipes.md (issue 18, item 6).

A model with ``nnx.Dropout`` keeps RNG state beside its params, so the recipe
splits ``nnx.Param`` from the rest (``...``), merges a copy inside the loss and
reseeds its dropout stream with the key the step gives each micro-batch.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_accum
from optax_accum._core import _checks

FEATURES, HIDDEN, CLASSES, ROWS, TIME, K, UPDATES = 6, 32, 5, 16, 10, 4, 6


class DropoutMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(jax.nn.tanh(self.hidden(x))))


def _split_model():
  model = DropoutMLP(nnx.Rngs(params=0, dropout=1))
  return nnx.split(model, nnx.Param, ...)


def _batches():
  """Per-token features and labels, sequences of very different lengths, and a
  dropout key per sequence that depends only on the update and the row."""
  rng = np.random.default_rng(0)
  base = jax.random.key(42)
  batches = []
  for update in range(UPDATES):
    lengths = np.where(
      rng.random(ROWS) < 0.5, rng.integers(1, 3, ROWS), rng.integers(7, 11, ROWS)
    )
    keys = jax.vmap(lambda row, u=update: jax.random.fold_in(base, u * ROWS + row))
    batches.append(
      {
        "x": rng.normal(size=(ROWS, TIME, FEATURES)).astype(np.float32),
        "labels": rng.integers(0, CLASSES, size=(ROWS, TIME)),
        "mask": (np.arange(TIME)[None, :] < lengths[:, None]).astype(np.float32),
        "row_key": np.asarray(jax.random.key_data(keys(jnp.arange(ROWS)))),
      }
    )
  return batches


def _token_mean_ce(logits, batch):
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
  return (ce * batch["mask"]).sum() / batch["mask"].sum(), batch["mask"].sum()


def _rel(a, b):
  return float(optax.tree.norm(jax.tree.map(jnp.subtract, a, b)) / optax.tree.norm(b))


ADAMW = optax.adamw(1e-2, weight_decay=0.01)


def test_a_dropout_model_needs_the_rest_of_its_state_split_off():
  """What the recipe works around: ``nnx.Param`` alone leaves the dropout's RNG
  state unclaimed, and flax refuses."""
  with pytest.raises(ValueError, match="Non-exhaustive filters"):
    nnx.split(DropoutMLP(nnx.Rngs(params=0, dropout=1)), nnx.Param)
  _, _, rest = _split_model()
  variables = jax.tree.leaves(rest, is_leaf=lambda v: isinstance(v, nnx.Variable))
  kinds = {type(v) for v in variables}
  assert kinds == {nnx.RngKey, nnx.RngCount}


_RECIPE = r'see "Flax NNX with dropout" in docs/recipes\.md'


def _whole_model_trees():
  """What a user passes as ``params`` by mistake: the whole state, or the
  model itself (an NNX module is a pytree)."""
  model = DropoutMLP(nnx.Rngs(params=0, dropout=1))
  return {"nnx.split(model)": nnx.split(model)[1], "model": model}


@pytest.mark.parametrize("tree", ["nnx.split(model)", "model"])
def test_rng_state_passed_as_params_points_to_the_recipe(tree):
  """Issue 43, item 8: the dropout's RNG counter (uint32) and key are not
  params; the error names the leaf and the recipe that splits them off, where
  it said only "only floating-point leaves can be accumulated". Raised by
  ``MultiSteps.init``, the first call that sees the params."""
  params = _whole_model_trees()[tree]
  opt = optax_accum.MultiSteps(ADAMW, every_k_schedule=K)
  with pytest.raises(
    ValueError, match=r"leaf .*count.* has dtype uint32: .*" + _RECIPE
  ):
    opt.init(params)


def test_the_rng_state_check_names_the_key_and_the_recipe():
  """The check ``MultiSteps.init`` calls, on its own; the section it points
  to exists."""
  params = _whole_model_trees()["nnx.split(model)"]
  with pytest.raises(
    ValueError, match=r"a PRNG key at \['dropout'\]\['rngs'\]\['key'\]"
  ):
    _checks.check_trainable_leaves(params, name="params")
  _, trainable, _ = _split_model()
  _checks.check_trainable_leaves(trainable, name="params")
  recipes = (pathlib.Path(__file__).parent.parent / "docs" / "recipes.md").read_text()
  assert "\n## Flax NNX with dropout\n" in recipes


# -- per-sequence keys: dropout masks that do not depend on the split -----------


def _per_row_loss(graphdef, rest, dropout=True):
  """Each sequence's dropout key comes with the data, so its mask is the same
  whether it sits in the whole batch or in any micro-batch."""

  def forward(params, x, row_key):
    model = nnx.merge(graphdef, params, rest, copy=True)
    nnx.reseed(model, dropout=jax.random.wrap_key_data(row_key))
    if not dropout:
      model = nnx.view(model, deterministic=True)
    return model(x[None])[0]

  def loss_fn(params, batch):
    logits = jax.vmap(forward, in_axes=(None, 0, 0))(
      params, batch["x"], batch["row_key"]
    )
    return _token_mean_ce(logits, batch)

  return loss_fn


@functools.cache
def _whole_batch_params(dropout):
  """The whole-batch params with per-sequence dropout keys (or none), computed
  once for both modes."""
  graphdef, params, rest = _split_model()
  return _whole_batch(_per_row_loss(graphdef, rest, dropout=dropout), params)


def _whole_batch(loss_fn, params):
  """The reference: plain optax, one AdamW update per whole batch."""

  @jax.jit
  def step(params, state, batch):
    grads, _ = jax.grad(loss_fn, has_aux=True)(params, batch)
    updates, state = ADAMW.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = ADAMW.init(params)
  for batch in _batches():
    params, state = step(params, state, batch)
  return params


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_dropout_with_per_sequence_keys_matches_the_whole_batch(mode):
  graphdef, params, rest = _split_model()
  loss_fn = _per_row_loss(graphdef, rest)
  want = _whole_batch_params(dropout=True)
  without_dropout = _whole_batch_params(dropout=False)

  opt = optax_accum.MultiSteps(ADAMW, K)
  step = optax_accum.make_train_step(loss_fn, opt, mode=mode)
  state = opt.init(params)
  for batch in _batches():
    window = optax_accum.split_micro_batches(batch, K)
    if mode == "scan":
      params, state, metrics = step(params, state, window)
    else:
      for i in range(K):
        micro_batch = jax.tree.map(lambda x, i=i: x[i], window)
        params, state, metrics = step(params, state, micro_batch)
    assert bool(metrics["updated"])

  assert _rel(params, want) <= 1e-5
  assert _rel(without_dropout, want) > 1e-3  # Dropout is on and matters.


# -- the step's key: the same rng on every call ---------------------------------


def _recipe_loss(graphdef, rest):
  """The recipe: the step passes each micro-batch's own key."""

  def loss_fn(params, batch, key):
    model = nnx.merge(graphdef, params, rest, copy=True)
    nnx.reseed(model, dropout=key)
    return _token_mean_ce(model(batch["x"]), batch)

  return loss_fn


@functools.cache
def _recipe_step(mode):
  """One step per mode, as a training script builds it once: the runs below
  differ only in the keys they pass."""
  graphdef, _, rest = _split_model()
  opt = optax_accum.MultiSteps(ADAMW, K)
  return opt, optax_accum.make_train_step(_recipe_loss(graphdef, rest), opt, mode=mode)


def _train(mode, key_for_call):
  _, params, _ = _split_model()
  opt, step = _recipe_step(mode)
  state = opt.init(params)
  call = 0
  for batch in _batches():
    window = optax_accum.split_micro_batches(batch, K)
    if mode == "scan":
      params, state, _ = step(params, state, window, key_for_call(call))
      call += 1
      continue
    for i in range(K):
      micro_batch = jax.tree.map(lambda x, i=i: x[i], window)
      params, state, _ = step(params, state, micro_batch, key_for_call(call))
      call += 1
  return params


def test_the_same_rng_on_every_call_gives_stream_the_keys_of_scan():
  """The step folds the micro-batch's position into ``rng``, so one key for the
  whole run gives streaming and scan mode the same dropout masks; a key
  derived per call (the natural thing to write) silently gives different ones."""
  rng = jax.random.key(0)
  scan = _train("scan", lambda call: rng)
  stream = _train("stream", lambda call: rng)
  assert _rel(stream, scan) <= 1e-5

  per_call = _train("stream", lambda call: jax.random.fold_in(rng, call))
  assert _rel(per_call, scan) > 1e-3
  other_rng = _train("stream", lambda call: jax.random.key(1))
  assert _rel(other_rng, scan) > 1e-3  # The key reaches the dropout.


def test_reseeding_a_stream_the_dropout_does_not_draw_from_changes_nothing():
  """The recipe's warning: with one seed, ``nnx.Rngs(0)``, dropout draws from
  the ``default`` stream, so reseeding ``dropout`` leaves every micro-batch
  the same mask; reseeding ``default`` gives each key its own."""
  graphdef, params, rest = nnx.split(DropoutMLP(nnx.Rngs(0)), nnx.Param, ...)
  x = _batches()[0]["x"]

  def forward(stream, key):
    model = nnx.merge(graphdef, params, rest, copy=True)
    nnx.reseed(model, **{stream: key})
    return model(x)

  one, two = jax.random.key(1), jax.random.key(2)
  np.testing.assert_array_equal(forward("dropout", one), forward("dropout", two))
  assert not np.array_equal(forward("default", one), forward("default", two))

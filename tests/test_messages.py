"""Issue 49, items 3 and 4: what users met on real code names its cause.

Each test reproduces the user's shape: params reused after the window end
that donated them, a checkpoint restored without a target, a Flax
``TrainState`` passed as params, a ``weights=`` typo, and no ``weight=``.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import optax_accum
from optax_accum.flax import TrainState

K = 2


def _loss(params, batch):
  return ((batch["x"] * params["w"][None]) ** 2).mean(), batch["x"].shape[0]


def _step(**kwargs):
  return optax_accum.make_train_step(
    _loss, optax_accum.MultiSteps(optax.adam(1e-2), K), **kwargs
  )


def _params():
  return {"w": jnp.ones(3)}  # A step donates the params it is given.


BATCH = {"x": jnp.ones((4, 3))}


def test_params_reused_after_the_window_end_name_donation():
  step = _step()
  params, state, _ = step(_params(), step.init(_params()), BATCH)
  _, state, _ = step(params, state, BATCH)  # Ends the window: donates.
  fix = r"`params` leaf \['w'\] was deleted.*donate=False"
  with pytest.raises(ValueError, match=fix):
    step(params, state, BATCH)
  kept = _step(donate=False)
  params, state, _ = kept(_params(), kept.init(_params()), BATCH)
  kept(params, state, BATCH)
  kept(params, state, BATCH)  # Its inputs are still there.


def test_a_checkpoint_restored_without_a_target_names_the_target(tmp_path):
  step = _step()
  params, state, _ = step(_params(), step.init(_params()), BATCH)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  ckpt.wait_until_finished()
  raw = ckpt.restore(tmp_path / "ckpt")
  fix = r"restored without a target.*step.init\(params\).*resume_target"
  for call in (step, _step(mode="scan")):
    with pytest.raises(ValueError, match=fix):
      call(raw["params"], raw["opt_state"], BATCH)


def test_a_flax_train_state_as_params_says_to_pass_its_params():
  step = _step()
  state = TrainState.create(apply_fn=None, params=_params(), tx=optax.adam(1e-2))
  with pytest.raises(ValueError, match=r"`params` is a TrainState.*state.params"):
    step(state, step.init(_params()), BATCH)


def test_a_typo_of_weight_is_refused_not_passed_to_the_inner_optimizer():
  opt = optax_accum.MultiSteps(optax.sgd(1.0), K)
  state = opt.init(_params())
  for typo, meant in [("weights", "weight"), ("losses", "loss")]:
    with pytest.raises(ValueError, match=rf"`{typo}=`.*did you mean `{meant}=`"):
      opt.update(_params(), state, **{typo: 3.0})
  opt.update(_params(), state, weight=3.0, value=1.0)  # For reduce_on_plateau.


def test_no_weight_warns_once_and_weight_one_asks_for_the_uniform_mean():
  opt = optax_accum.MultiSteps(optax.sgd(1.0), K)
  state = opt.init(_params())
  step = jax.jit(opt.update)
  with pytest.warns(UserWarning, match=r"no `weight=`.*uniform mean.*weight=1") as seen:
    for _ in range(2 * K):
      _, state = step(_params(), state)
    opt.update(_params(), state)
  assert len(seen) == 1  # Once for the optimizer, not per call or trace.
  # It gives the rule, not one count: what the loss divides by, each usual case.
  rule = str(seen[0].message)
  for words in (
    "the count your loss divides by",
    "tokens for a token mean",
    "rows for a mean of per-row means",
    "grad_reduction='window_mean'",
  ):
    assert words in rule, words
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optax_accum.MultiSteps(optax.sgd(1.0), K).update(_params(), state, weight=1)

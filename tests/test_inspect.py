"""`get_hyperparams` and `get_update_count` find what logging needs, anywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

SCHEDULE = optax.linear_schedule(1.0, 0.0, 10)


def _adamw():
  return optax.inject_hyperparams(optax.adamw)(
    weight_decay=0.1, learning_rate=optax_accum.progress_schedule(SCHEDULE)
  )


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_accum.MultiSteps(optax.chain(optax.clip(1.0), _adamw()), 2),
    lambda: optax.chain(
      optax.clip(1.0), optax_accum.MultiSteps(_adamw(), 2).gradient_transformation()
    ),
    lambda: optax.MultiSteps(optax.chain(optax.clip(1.0), _adamw()), 2),
  ],
  ids=["optax_accum.MultiSteps(chain)", "chain(MultiSteps)", "optax.MultiSteps"],
)
def test_nested_states_inside_and_outside_jit(make):
  opt = make()
  params = {"w": jnp.ones(3)}
  state = opt.init(params)

  @jax.jit
  def step(state):
    _, state = opt.update({"w": jnp.ones(3)}, state, params)
    hyperparams = optax_accum.get_hyperparams(state)
    return state, hyperparams["learning_rate"], optax_accum.get_update_count(state)

  for micro_step in range(6):
    state, lr_in_jit, count_in_jit = step(state)
    assert (
      int(count_in_jit)
      == int(optax_accum.get_update_count(state))
      == (micro_step + 1) // 2
    )
    hyperparams = optax_accum.get_hyperparams(state)
    assert next(iter(hyperparams)) == "learning_rate"
    assert float(hyperparams["learning_rate"]) == float(lr_in_jit)
  np.testing.assert_allclose(
    float(lr_in_jit), SCHEDULE(2), rtol=1e-6
  )  # Used by update 3.
  np.testing.assert_allclose(float(hyperparams["weight_decay"]), 0.1, rtol=1e-6)


def test_update_count_prefers_real_updates_over_call_counts():
  """Called on every micro-step, inject_hyperparams counts calls, not updates."""
  opt = _adamw()
  state = opt.init(jnp.zeros(2))
  for i in range(6):
    ends = jnp.float32(i % 3 == 2)
    _, state = opt.update(jnp.ones(2), state, jnp.zeros(2), window_weight=ends)
  assert int(state.count) == 6
  assert int(optax_accum.get_update_count(state)) == 2


def test_errors_say_what_is_missing():
  state = optax.adam(0.1).init(jnp.zeros(2))
  with pytest.raises(
    ValueError, match=r"wrap the optimizer in optax\.inject_hyperparams"
  ):
    optax_accum.get_hyperparams(state)
  with pytest.raises(ValueError, match="No update counter in this optimizer state"):
    optax_accum.get_update_count(state)


def test_every_groups_hyperparams_by_label():
  """A name several injected states define maps to each one's value, by label."""
  inject = optax.inject_hyperparams
  tx = optax.multi_transform(
    {
      "body": inject(optax.adamw)(learning_rate=0.1, weight_decay=0.1),
      "head": optax.chain(
        inject(optax.sgd)(learning_rate=0.2), inject(optax.sgd)(learning_rate=0.3)
      ),
    },
    {"w": "body", "b": "head"},
  )
  state = optax_accum.MultiSteps(tx, 2).init({"w": jnp.ones(3), "b": jnp.ones(2)})
  hyperparams = jax.jit(optax_accum.get_hyperparams)(state)
  assert next(iter(optax_accum.get_hyperparams(state))) == "learning_rate"
  values = jax.tree.map(float, hyperparams["learning_rate"])
  # Two states share the label "head": each keeps its path after it.
  assert values == pytest.approx(
    {"body": 0.1, "head.inner_state[0]": 0.2, "head.inner_state[1]": 0.3}
  )
  assert float(hyperparams["weight_decay"]) == pytest.approx(0.1)  # Only one.
  chain = optax.chain(
    inject(optax.sgd)(learning_rate=0.2), inject(optax.sgd)(learning_rate=0.3)
  )
  values = optax_accum.get_hyperparams(chain.init(jnp.ones(2)))["learning_rate"]
  assert jax.tree.map(float, values) == pytest.approx({"[0]": 0.2, "[1]": 0.3})


def test_last_window_needs_an_optax_accum_state():
  with pytest.raises(ValueError, match=r"No optax_accum.MultiStepsState"):
    optax_accum.get_last_window(optax.MultiSteps(optax.sgd(0.1), 2).init(0.0))

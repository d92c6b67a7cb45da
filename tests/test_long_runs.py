"""Counters after 10^9 updates and 10^13 tokens: exact, and never wrapping.

The state is driven to those values directly, then advanced by real calls.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

UPDATES = 10**9
TOKENS = 10**13
PARAMS = {"w": jnp.ones(3)}


def _items(state: optax_accum.ProgressState, per_update: int) -> int:
  """The exact item count a progress state holds (Python ints: no rounding)."""
  whole = int(state.whole_high) * 2**30 + int(state.whole_low)
  return whole * per_update + int(state.remainder)


@pytest.mark.parametrize("per_update", [1, 4096])
def test_progress_counts_ten_trillion_tokens_exactly(per_update):
  schedule = optax_accum.progress_schedule(
    lambda p: p, unit="weight", per_update=per_update
  )
  update = jax.jit(schedule.update)
  whole, remainder = divmod(TOKENS, per_update)
  state = schedule.init()._replace(
    whole_high=jnp.int32(whole // 2**30),
    whole_low=jnp.int32(whole % 2**30),
    remainder=jnp.float32(remainder),
  )
  assert _items(state, per_update) == TOKENS
  # A huge window is split exactly too: 2**41 tokens is a float32.
  state = update(state, window_weight=jnp.float32(2.0**41))
  assert _items(state, per_update) == TOKENS + 2**41
  # Then real windows of a few thousand tokens keep counting exactly.
  for window in (3001, 4096, 1):
    state = update(state, window_weight=jnp.float32(window))
  assert _items(state, per_update) == TOKENS + 2**41 + 7098
  assert 0 <= int(state.whole_low) < 2**30
  progress = float(schedule.progress(state))
  exact = (TOKENS + 2**41 + 7098) / per_update
  assert abs(progress - exact) <= 6e-8 * exact  # One float32 rounding.
  assert int(state.updates) == 4


def test_a_billion_updates_later_everything_still_counts():
  lr = optax_accum.progress_schedule(lambda n: 1.0 / (1.0 + n))
  opt = optax_accum.MultiSteps(
    optax.inject_hyperparams(optax.sgd)(learning_rate=lr),
    every_k_schedule=2,
    on_nonfinite="skip_micro_batch",
  )
  state = opt.init(PARAMS)
  hyper = state.inner_opt_state.hyperparams_states["learning_rate"]
  billion = jnp.int32(UPDATES)
  state = state._replace(
    gradient_step=billion,
    skipped_micro_batches=billion,
    skipped_windows=billion,
    inner_opt_state=state.inner_opt_state._replace(
      count=billion,
      hyperparams_states={"learning_rate": hyper._replace(updates=billion)},
    ),
  )
  step = jax.jit(opt.update)
  _, state = step({"w": jnp.full(3, jnp.nan)}, state)  # A skipped micro-batch.
  _, state = step({"w": jnp.ones(3)}, state)
  assert bool(state.updated)
  assert int(state.gradient_step) == UPDATES + 1
  assert int(state.skipped_micro_batches) == UPDATES + 1
  assert int(optax_accum.get_update_count(state)) == UPDATES + 1
  lr_now = float(optax_accum.get_hyperparams(state)["learning_rate"])
  np.testing.assert_allclose(lr_now, 1.0 / (1.0 + UPDATES + 1), rtol=1e-7)

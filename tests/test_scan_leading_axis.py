"""Scan mode refuses a batch that was not split into micro-batches.

Issue 43, item 7: an unsplit batch of 8 rows given to a scan-mode step whose
`MultiSteps` has `every_k_schedule=4` ran a window of 8 micro-batches of one
row each, without a word. A leading axis that is a multiple of an int `k`
beyond it is now a `ValueError` naming the sizes and the fix. Other leading
axes still set the window (the rest of a half-streamed window, a short last
window), and so does any axis for a plain optax optimizer's step (which has
no `k`) or under `every_k_schedule="end_window"`.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

ROWS, K = 8, 4


def _loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"]) ** 2), jnp.float32(batch["x"].shape[0])


def _batch():
  return {"x": np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3) / 10}


def _params():
  return {"w": jnp.ones((3,))}


def _scan(opt):
  return optax_accum.make_train_step(_loss, opt, mode="scan", donate=False)


def test_an_unsplit_batch_is_refused_with_the_fix():
  opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=K)
  fix = r"8 along it, 2 times `every_k_schedule`=4.*split_micro_batches\(batch, 4\)"
  with pytest.raises(ValueError, match=fix):
    _scan(opt)(_params(), opt.init(_params()), _batch())


@pytest.mark.parametrize(
  ("every_k_schedule", "stacked"),
  [(K, K), (K, 2), (3, K), ("end_window", ROWS)],
  ids=["k", "fewer", "not-a-multiple", "end_window"],
)
def test_other_leading_axes_set_the_window(every_k_schedule, stacked):
  opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=every_k_schedule)
  batch = optax_accum.split_micro_batches(_batch(), stacked)
  _, _, metrics = _scan(opt)(_params(), opt.init(_params()), batch)
  assert int(metrics["micro_steps"]) == stacked
  assert int(metrics["update_count"]) == 1


def test_a_plain_optax_optimizer_takes_any_leading_axis():
  """Its step holds `every_k_schedule=1` for a window it never counts."""
  tx = optax.sgd(0.1)
  _, _, metrics = _scan(tx)(_params(), tx.init(_params()), _batch())
  assert int(metrics["micro_steps"]) == ROWS

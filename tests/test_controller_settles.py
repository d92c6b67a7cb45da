"""Issue 71: the controller on gradients of a known, constant noise scale.

The loss ``mean_rows(x) . params`` has the gradient ``mean_rows(x)``; rows draw
``x ~ N(mu, I)`` in ``DIM`` dimensions, so each row (item) is a gradient of mean
``mu`` and covariance ``I``: ``B_simple = tr(Sigma) / |mu|^2 = 1 / mu_j^2``
rows. ``MultiSteps(noise_scale=True)`` measures real micro-batch gradients
(``optax.sgd(0)``: the gradient does not depend on the params), and the
controller sizes the windows from them.
"""

import itertools
import math

import jax
import numpy as np
import optax

import optax_accum

DIM, ROWS = 64, 8


def loss_fn(params, batch):
  n = batch["mask"].sum()
  return (batch["mask"][:, None] * batch["x"] @ params).sum() / n, n


def _optimizer():
  return optax_accum.MultiSteps(
    optax.sgd(0.0), every_k_schedule="end_window", noise_scale=True
  )


def _rows(rng, count, b_simple):
  mu = np.full(DIM, 1 / math.sqrt(b_simple), np.float32)
  return mu + rng.normal(size=(count, ROWS, DIM)).astype(np.float32)


def run_scan(ctl, b_simple, windows, seed, step=None):
  """Scan mode: ``choose_k`` micro-batches a window; each window's target."""
  step = step or optax_accum.make_train_step(loss_fn, _optimizer(), mode="scan")
  rng = np.random.default_rng(seed)
  params = jax.numpy.zeros(DIM)
  state, cstate, targets = step.init(params), ctl.init(), []
  for _ in range(windows):
    k = ctl.choose_k(cstate, ROWS)
    window = {"x": _rows(rng, k, b_simple), "mask": np.ones((k, ROWS), np.float32)}
    params, state, metrics = step(params, state, window)
    cstate, _ = ctl.add(cstate, float(k * ROWS), micro_batches=k)
    cstate, record = ctl.end(cstate, metrics)
    targets.append(record["target"])
  return targets, step


def run_stream(ctl, b_simple, windows, seed, step=None):
  """Streaming: one micro-batch a call, ``add`` says where windows end."""
  step = step or optax_accum.make_train_step(loss_fn, _optimizer())
  rng = np.random.default_rng(seed)
  params = jax.numpy.zeros(DIM)
  state, cstate, targets, sizes = step.init(params), ctl.init(), [], []
  while len(targets) < windows:
    batch = {"x": _rows(rng, 1, b_simple)[0], "mask": np.ones(ROWS, np.float32)}
    cstate, end = ctl.add(cstate, float(ROWS))
    params, state, metrics = step(params, state, batch, end_window=end)
    if end:
      cstate, record = ctl.end(cstate, metrics)
      targets.append(record["target"])
      sizes.append(record["micro_batches"])
  return targets, sizes, step


def test_the_target_settles_on_scale_times_b_simple_over_ten_seeds():
  """``scale * B_simple`` = 0.5 x 256 = 128 rows is a rung (16 x 2^3): from
  ``min_weight`` 16 the target climbs to it, never above 2 x 128 (a rung above
  it is a noisy excursion the bounds walk back), and its last 30 of 80 windows
  are all on it, on each of 10 seeds."""
  ctl = optax_accum.WindowController(16, 1024, scale=0.5)
  want, step = 0.5 * 256, None
  for seed in range(10):
    targets, step = run_scan(ctl, 256.0, 80, seed, step)
    assert max(targets) <= 2 * want, (seed, targets)
    assert targets[-30:] == [want] * 30, (seed, targets)
    assert targets.index(want) <= 45, (seed, targets)
    steps = {b / a for a, b in itertools.pairwise(targets) if a != b}
    assert steps <= {2.0, 0.5}, (seed, targets)  # One rung at a time.


def test_between_rungs_the_target_is_the_nearest_rung():
  """``scale * B_simple`` = 80 rows lies between the rungs 64 and 128: the
  target settles on 64, the nearest (on a log scale), within sqrt(2) of it."""
  ctl = optax_accum.WindowController(16, 1024, scale=0.5)
  step = None
  for seed in range(3):
    targets, step = run_scan(ctl, 160.0, 50, seed, step)
    assert max(targets) <= 2 * 80, targets
    assert targets[-20:] == [64.0] * 20, (seed, targets)


def test_one_micro_batch_of_min_weight_leaves_it_streaming():
  """``min_weight`` one micro-batch: each window still holds two (a window of
  one unit measures nothing), and the target leaves ``min_weight`` for
  ``scale * B_simple`` = 64 rows = 8 micro-batches."""
  ctl = optax_accum.WindowController(ROWS, 512, scale=0.5)
  targets, sizes, _ = run_stream(ctl, 128.0, 40, seed=0)
  assert min(sizes) == 2 and sizes[0] == 2, sizes
  assert targets[0] == ROWS and targets[-1] == 64.0, targets


def test_one_micro_batch_of_min_weight_leaves_it_in_scan_mode():
  ctl = optax_accum.WindowController(ROWS, 512, scale=0.5)
  assert ctl.ks(ROWS)[0] == 2 and 1 not in ctl.ks(ROWS)
  targets, _ = run_scan(ctl, 128.0, 40, seed=1)
  assert targets[0] == ROWS and targets[-1] == 64.0, targets

"""Issue 62: a window size that follows the gradient noise scale.

Synthetic gradients of known ``B_simple``: the loss ``mean_rows(x) . params``
has the gradient ``mean_rows(x)``, and rows draw ``x ~ N(mu, s^2 I)``, so a
micro-batch of ``w`` rows is a unit of gradient ``N(mu, s^2 I / w)`` and
``B_simple = tr(Sigma) / |mu|^2 = s^2 / mu_j^2 = 64`` rows. On each path the
windows end where the rule says, given the window estimates the run measured
(``WindowController``'s docstring), and the smoothed estimate comes near 64.
"""

import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import array as jax_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum._progress import _window_controller
from optax_accum._step import _host

DIM, ROWS, TRUE_B = 128, 8, 64.0
LOW, HIGH = 16.0, 256.0


def loss_fn(params, batch):
  n = batch["mask"].sum()
  return (batch["mask"][:, None] * batch["x"] @ params).sum() / n, n


def _batches(count, rows=ROWS, seed=0, b_simple=TRUE_B):
  rng = np.random.default_rng(seed)
  mu = np.full(DIM, 1 / math.sqrt(b_simple), np.float32)
  x = mu + rng.normal(size=(count, rows, DIM)).astype(np.float32)
  return [{"x": b, "mask": np.ones(rows, np.float32)} for b in x]


def _controller():
  return optax_accum.WindowController(LOW, HIGH, scale=1.0, decay=0.8)


def _rule(measured, ctl, per=ROWS, ks=None):
  """The window sizes the docstring's rule gives for these measurements: each
  window's bounds read one window late, ``patience`` votes in a row to move a
  rung."""
  sizes, target, streak = [], float(ctl.min_weight), 0
  state = ctl.init()
  ema, spread, reading = state.ema, state.spread, np.array([0.0, 0.0, np.inf])
  for noise in measured:
    if ks is None:
      sizes.append(max(math.ceil(target / per), ctl.min_micro_batches))
    else:
      sizes.append(next((k for k in ks if k * per >= target), ks[-1]))
    low, high = reading[1], reading[2]  # One window late.
    new, ema, spread = _window_controller._measure(
      noise, ema, spread, np.float32(ctl.decay), np.float32(ctl.confidence)
    )
    reading = np.asarray(new, np.float64)
    target, streak = ctl._step(low, high, target, streak)
  return sizes, reading[0]


def _stream(step, params, batches, ctl, windows):
  """Streams until ``windows`` end; each window's size and measurement."""
  state, cstate, seen = step.init(params), ctl.init(), []
  for batch in batches:
    cstate, end = ctl.add(cstate, float(batch["mask"].sum()))
    params, state, metrics = step(params, state, batch, end_window=end)
    if end:
      cstate, record = ctl.end(cstate, metrics)
      seen.append((record["micro_batches"], metrics["noise_scale"]))
      if len(seen) == windows:
        break
  return [k for k, _ in seen], jax.device_get([m for _, m in seen]), cstate


def _sgd0():
  return optax_accum.MultiSteps(
    optax.sgd(0.0), every_k_schedule="end_window", noise_scale=True
  )


def test_the_rule_on_host_numbers():
  ctl = optax_accum.WindowController(16, 256, scale=0.5, patience=2)
  assert ctl.rungs() == (16.0, 32.0, 64.0, 128.0, 256.0)
  assert optax_accum.WindowController(16, 100).rungs() == (16.0, 32.0, 64.0, 100.0)
  # 0.5 x low >= sqrt(32 x 64) = 45.3 asks for 64; two votes in a row move it.
  assert ctl._step(91.0, np.inf, 32.0, 0) == (32.0, 1)
  assert ctl._step(91.0, np.inf, 32.0, 1) == (64.0, 0)
  assert ctl._step(90.0, np.inf, 32.0, 1) == (32.0, 0)  # Not enough: no vote.
  # 0.5 x high <= sqrt(32 x 16) = 22.6 asks for 16.
  assert ctl._step(0.0, 45.0, 32.0, -1) == (16.0, 0)
  assert ctl._step(0.0, 46.0, 32.0, -1) == (32.0, 0)
  # No evidence: bounds 0 and inf (fewer than two windows, |G|^2 not > 0), NaN.
  for low, high in [(0.0, np.inf), (np.nan, np.nan), (-5.0, -1.0)]:
    assert ctl._step(low, high, 32.0, 1)[1] in (0, -1)
    assert ctl._step(low, high, 32.0, 1)[0] == 32.0
  assert ctl._step(1e9, np.inf, 256.0, 5) == (256.0, 0)  # The top rung.
  grow_only = optax_accum.WindowController(16, 256, grow_only=True, patience=1)
  assert grow_only._step(0.0, 1.0, 64.0, 0) == (64.0, 0)
  assert ctl.ks(8) == (2, 4, 8, 16, 32) and ctl.ks(6) == (3, 4, 8, 16, 32, 42)
  assert ctl.ks(1000) == (2,)  # A window measures at least two units.
  assert optax_accum.WindowController(16, 256, min_micro_batches=1).ks(16)[0] == 1
  for bad, match in [
    (dict(min_weight=0, max_weight=4), "`min_weight` must be a finite number > 0"),
    (dict(min_weight=8, max_weight=4), "`max_weight` must be >= `min_weight`"),
    (dict(min_weight=1, max_weight=4, decay=1.0), r"`decay` must be a number in"),
    (dict(min_weight=1, max_weight=4, growth=1.0), r"`growth` must be a number > 1"),
    (dict(min_weight=1, max_weight=4, patience=0), r"`patience` must be an integer"),
    (dict(min_weight=1, max_weight=4, confidence=-1), r"`confidence` must be a"),
    (dict(min_weight=1, max_weight=4, min_micro_batches=1.5), "`min_micro_batches`"),
  ]:
    with pytest.raises(ValueError, match=match):
      optax_accum.WindowController(**bad)
  with pytest.raises(ValueError, match="`weight` must be a host number"):
    ctl.add(ctl.init(), jnp.float32(3.0))


@pytest.mark.parametrize(
  "weight",
  [float("inf"), float("-inf"), float("nan"), -1.0, np.float32(np.inf), "3", True],
)
def test_add_refuses_weights_that_are_not_finite_and_not_negative(weight):
  """Issue 69: ``MultiSteps`` drops a micro-batch of weight inf or NaN, so the
  controller must not count it either (nor a negative one)."""
  ctl = _controller()
  with pytest.raises(ValueError, match=r"`weight` must be a finite number >= 0, got"):
    ctl.add(ctl.init(), weight)
  with pytest.raises(ValueError, match=re.escape(repr(weight))):
    ctl.add(ctl.init(), weight)


@pytest.mark.parametrize("count", [-3, 0, 2.5, 2.0, float("nan"), float("inf"), True])
def test_add_refuses_counts_that_are_not_positive_integers(count):
  ctl = _controller()
  with pytest.raises(ValueError, match=r"`micro_batches` must be an integer >= 1, got"):
    ctl.add(ctl.init(), 8.0, micro_batches=count)
  state, _ = ctl.add(ctl.init(), 8.0, micro_batches=np.int64(3))
  assert int(state.micro_batches) == 3 and float(state.weight) == 8.0


def test_end_without_a_noise_measurement_names_the_fix():
  """Issue 69: a train step of an optimizer without ``noise_scale=True`` has no
  ``"noise_scale"`` metric; ``end`` says how to get one, not ``KeyError``."""
  ctl = _controller()
  state, _ = ctl.add(ctl.init(), 20.0)
  plain = optax_accum.MultiSteps(optax.sgd(0.0), every_k_schedule="end_window")
  step = optax_accum.make_train_step(loss_fn, plain)
  params = jnp.zeros(DIM)
  _, _, metrics = step(params, step.init(params), _batches(1)[0], end_window=True)
  assert "noise_scale" not in metrics
  fix = r"MultiSteps\(\.\.\., noise_scale=True\)"
  for given in (metrics, metrics | {"noise_scale": None}, {}):
    with pytest.raises(ValueError, match=r"make_train_step.*" + fix):
      ctl.end(state, given)
  with pytest.raises(ValueError, match="is absent"):
    ctl.end(state, metrics)
  with pytest.raises(ValueError, match="is None"):
    ctl.end(state, {"noise_scale": None})
  with pytest.raises(ValueError, match=r"lacks \['units'\]"):
    ctl.end(state, {"noise_scale": {"squared_norm": 1.0, "trace": 2.0}})
  with pytest.raises(ValueError, match=r"`metrics` must be the metrics.*got NoneType"):
    ctl.end(state, None)
  assert float(state.weight) == 20.0  # Nothing changed.


def test_add_takes_numpy_scalars_as_jax_device_get_gives_them():
  """``jax.device_get`` of a scalar is a 0-d NumPy array: a host number."""
  ctl = _controller()
  weight, count = jax.device_get(jnp.float32(5.0)), np.asarray(2)
  state, _ = ctl.add(ctl.init(), weight, micro_batches=count)
  assert (float(state.weight), int(state.micro_batches)) == (5.0, 2)
  with pytest.raises(ValueError, match=r"`weight` must be a finite number >= 0"):
    ctl.add(state, np.asarray(np.inf))


def test_streaming_windows_follow_the_rule():
  ctl = _controller()
  step = optax_accum.make_train_step(loss_fn, _sgd0())
  sizes, measured, cstate = _stream(step, jnp.zeros(DIM), _batches(400), ctl, 24)
  want, b = _rule(measured, ctl)
  assert sizes == want
  assert sizes[:2] == [2, 2] and sizes[-1] == 8, sizes  # 64 rows: B_simple.
  assert abs(b / TRUE_B - 1) < 0.35, b
  assert float(cstate.estimate) > 0 and int(cstate.streak) >= 0


def test_multi_steps_update_in_the_users_loop():
  ctl, opt = _controller(), _sgd0()
  params = jnp.zeros(DIM)

  @jax.jit
  def micro_step(state, batch, end):
    (_, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    _, state = opt.update(grads, state, params, weight=n, end_window=end)
    return state

  state, cstate, sizes, measured = opt.init(params), ctl.init(), [], []
  for batch in _batches(300, seed=1):
    cstate, end = ctl.add(cstate, float(batch["mask"].sum()))
    state = micro_step(state, batch, end)
    if end:
      window = optax_accum.get_last_window(state)
      cstate, record = ctl.end(cstate, window)
      sizes.append(record["micro_batches"])
      measured.append(window["noise_scale"])
      if len(sizes) == 20:
        break
  assert sizes == _rule(jax.device_get(measured), ctl)[0]
  assert sizes[-1] >= 4, sizes


def test_scan_mode_chooses_from_a_bounded_set_of_sizes():
  ctl = _controller()
  ks = ctl.ks(ROWS)
  assert ks == (2, 4, 8, 16, 32)
  step = optax_accum.make_train_step(loss_fn, _sgd0(), mode="scan")
  params, batches = jnp.zeros(DIM), iter(_batches(400, seed=2))
  state, cstate, sizes, measured = step.init(params), ctl.init(), [], []
  for _ in range(16):
    k = ctl.choose_k(cstate, ROWS)
    window = jax.tree.map(lambda *x: np.stack(x), *[next(batches) for _ in range(k)])
    params, state, metrics = step(params, state, window)
    cstate, _ = ctl.add(cstate, float(window["mask"].sum()), micro_batches=k)
    cstate, record = ctl.end(cstate, metrics)
    sizes.append(record["micro_batches"])
    measured.append(metrics["noise_scale"])
  assert sizes == _rule(jax.device_get(measured), ctl, ks=ks)[0]
  assert set(sizes) <= set(ks) and len(set(sizes)) >= 2, sizes
  # One compiled window program per size used, never more than len(ks).
  assert step.update_program.jitted._cache_size() == len(set(sizes)) <= len(ks)


def test_eight_replicas_with_axis_name():
  """Each replica's rows of a micro-batch are a unit: 8 units a micro-batch,
  and the controller counts the items of all replicas (B_simple 512 rows)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  ctl = optax_accum.WindowController(2 * 8 * ROWS, 1024, decay=0.8)
  step = optax_accum.make_train_step(loss_fn, _sgd0(), axis_name="data")
  rows = NamedSharding(mesh, P("data"))
  batches = [
    jax.device_put(b, rows) for b in _batches(60, rows=8 * ROWS, seed=3, b_simple=512.0)
  ]
  with jax.set_mesh(mesh):
    params = jax.device_put(jnp.zeros(DIM), NamedSharding(mesh, P()))
    state, cstate, sizes, measured = step.init(params), ctl.init(), [], []
    for batch in batches:
      cstate, end = ctl.add(cstate, 8.0 * ROWS)  # All rows of all replicas.
      params, state, metrics = step(params, state, batch, end_window=end)
      if end:
        cstate, record = ctl.end(cstate, metrics)
        sizes.append(record["micro_batches"])
        measured.append(jax.device_get(metrics["noise_scale"]))
        if len(sizes) == 8:
          break
  assert [float(m["units"]) for m in measured] == [8.0 * k for k in sizes]
  assert sizes == _rule(measured, ctl, per=8 * ROWS)[0]
  assert sizes[0] == 2 and max(sizes) > 2, sizes


def test_no_host_read_inside_a_window(monkeypatch):
  """Between a window's first and last micro-batch neither the step nor the
  controller reads anything from the device; a window's end reads one scalar
  (the controller's estimate of the window before)."""
  reads = []
  value = jax_array.ArrayImpl._value
  host_int = _host._host_int
  monkeypatch.setattr(
    jax_array.ArrayImpl, "_value", property(lambda x: reads.append(1) or value.fget(x))
  )
  monkeypatch.setattr(_host, "_host_int", lambda x: reads.append(1) or host_int(x))
  ctl = _controller()
  step = optax_accum.make_train_step(loss_fn, _sgd0())
  params, state, cstate = jnp.zeros(DIM), None, ctl.init()
  state = step.init(params)
  inside, at_ends, windows = 0, [], 0
  for i, batch in enumerate(_batches(120, seed=4)):
    before = len(reads)
    cstate, end = ctl.add(cstate, float(batch["mask"].sum()))
    params, state, metrics = step(params, state, batch, end_window=end)
    if end:
      cstate, _ = ctl.end(cstate, metrics)
      at_ends.append(len(reads) - before)
      windows += 1
    elif i > 0:  # The very first call reads the counters of a state it never saw.
      inside += len(reads) - before
  assert windows >= 8 and inside == 0
  assert set(at_ends[1:]) == {1}, at_ends


def _ramp_step():
  reference = 4 * ROWS
  lr = optax_accum.progress_schedule(
    optax.cosine_decay_schedule(1e-2, 40), unit="weight", per_update=reference
  )
  inner = optax.inject_hyperparams(optax_accum.adamw_in_items)(
    learning_rate=lr, reference_weight=reference
  )
  opt = optax_accum.MultiSteps(inner, every_k_schedule="end_window", noise_scale=True)
  return optax_accum.make_train_step(loss_fn, opt)


def _run(step, params, state, cstate, batches, sizes):
  for batch in batches:
    cstate, end = ctl_add(cstate, batch)
    params, state, metrics = step(params, state, batch, end_window=end)
    if end:
      cstate, record = _controller().end(cstate, metrics)
      sizes.append(record["micro_batches"])
  return params, state, cstate


def ctl_add(cstate, batch):
  return _controller().add(cstate, float(batch["mask"].sum()))


def test_a_mid_run_orbax_restore_gives_the_same_windows_and_params(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  batches, cut = _batches(160, seed=5), 77  # Mid-window.
  step = _ramp_step()
  params = jnp.zeros(DIM)
  whole = []
  want = _run(step, params, step.init(params), _controller().init(), batches, whole)
  step = _ramp_step()  # A new process's step.
  params = jnp.zeros(DIM)
  first = []
  saved = _run(
    step, params, step.init(params), _controller().init(), batches[:cut], first
  )
  assert saved[2].micro_batches > 0  # Mid-window.
  checkpointer = ocp.StandardCheckpointer()
  names = ("params", "opt", "controller")
  checkpointer.save(tmp_path / "ckpt", dict(zip(names, saved, strict=True)))
  checkpointer.wait_until_finished()
  step = _ramp_step()
  fresh = jnp.zeros(DIM)
  target = dict(
    zip(names, (fresh, step.init(fresh), _controller().init()), strict=True)
  )
  restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target)
  rest = []
  got = _run(step, *(restored[n] for n in names), batches[cut:], rest)
  assert first + rest == whole and len(set(whole)) >= 3, whole
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert float(got[2].target) == float(want[2].target)


class _StateBeforeIssue71(NamedTuple):
  """``WindowControllerState`` as 0.x saved it (no spread, bounds or streak)."""

  ema: optax_accum.NoiseScaleEMA
  b_simple: jax.Array
  estimate: np.ndarray
  target: np.ndarray
  weight: np.ndarray
  micro_batches: np.ndarray


def test_a_checkpoint_from_before_issue_71_restores_through_restore(tmp_path):
  """Its fields by name (orbax without a target) give a state with its target
  and its window so far; the measurement starts again, and the run goes on."""
  ocp = pytest.importorskip("orbax.checkpoint")
  zero = jnp.zeros([], jnp.float32)
  old = _StateBeforeIssue71(
    optax_accum.NoiseScaleEMA(zero + 1, zero + 64, zero + 0.5),
    zero + 64,
    np.array(60.0),
    np.array(32.0),
    np.array(8.0),
    np.array(1, np.int64),
  )
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "old", {"controller": old})
  checkpointer.wait_until_finished()
  tree = ocp.StandardCheckpointer().restore(tmp_path / "old")["controller"]
  ctl = _controller()
  state = ctl.restore(tree)
  assert (float(state.target), float(state.weight), int(state.micro_batches)) == (
    32.0,
    8.0,
    1,
  )
  assert float(state.ema.total) == 0.0  # The measurement restarts.
  state, end = ctl.add(state, 8.0)
  assert not end  # 16 < 32 items.
  # A state of this version round-trips through its fields by name too.
  checkpointer.save(tmp_path / "new", {"controller": state})
  checkpointer.wait_until_finished()
  tree = ocp.StandardCheckpointer().restore(tmp_path / "new")["controller"]
  again = ctl.restore(tree)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="must be a WindowControllerState"):
    ctl.restore({"ema": 1})

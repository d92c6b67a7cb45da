"""Issue 51: the gradient noise scale of every window, token-weighted.

The estimator is checked three ways: against a float64 NumPy computation from
each unit's own gradient, on every path (the window's numbers, not their
statistics); on synthetic gradients of known mean and covariance (the mean of
many windows' estimates within its Monte-Carlo error of the truth, and their
variance as docs/noise_scale.md gives it); and against per-example gradients
(``jax.vmap(jax.grad)``) of a small model, on one device and on an 8-device
mesh, for equal and unequal micro-batch weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

IN, OUT, ROWS, K = 3, 2, 16, 4


def _params():
  rng = np.random.default_rng(1)
  return {
    "w": jnp.asarray(rng.normal(size=(IN, OUT)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=OUT), jnp.float32),
  }


def loss_fn(params, batch):
  """Mean squared error over the valid rows, and their count."""
  err = batch["x"] @ params["w"] + params["b"][None] - batch["y"]
  n = batch["mask"].sum()
  return (batch["mask"] * (err**2).sum(-1)).sum() / jnp.maximum(n, 1), n


def _micro_batches(count, seed=0, empty=()):
  """Micro-batches of uneven valid rows (``empty``: indices with none)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(count):
    mask = (rng.random(ROWS) < rng.uniform(0.2, 0.9)).astype(np.float32)
    mask[rng.integers(ROWS)] = 1.0
    if i in empty:
      mask[:] = 0.0
    out.append(
      {
        "x": rng.normal(size=(ROWS, IN)).astype(np.float32),
        "y": (3 * rng.normal(size=(ROWS, OUT))).astype(np.float32),
        "mask": mask,
      }
    )
  return out


def _unit_gradient(params, batch, rows=slice(None)):
  """A unit's mean gradient and weight over ``rows``, float64 NumPy."""
  w = np.asarray(params["w"], np.float64)
  b = np.asarray(params["b"], np.float64)
  x, y = batch["x"][rows].astype(np.float64), batch["y"][rows].astype(np.float64)
  m = batch["mask"][rows].astype(np.float64)
  n = m.sum()
  r = (x @ w + b - y) * m[:, None]
  grad = np.concatenate([(2 * x.T @ r).ravel(), 2 * r.sum(0)]) / max(n, 1)
  return grad, n


def expected(units):
  """The window's estimates from its units ``[(gradient, weight)]`` (float64)."""
  units = [(g, w) for g, w in units if w > 0]
  k = len(units)
  total = sum(w for _, w in units)
  mean = sum(w * g for g, w in units) / total
  a = sum(w * g @ g for g, w in units) / total
  if k < 2:
    return {"squared_norm": 0.0, "trace": 0.0, "units": float(k)}
  return {
    "squared_norm": (k * mean @ mean - a) / (k - 1),
    "trace": total * (a - mean @ mean) / (k - 1),
    "units": float(k),
  }


def _close(got, want, rtol=2e-4):
  for name in ("squared_norm", "trace", "units"):
    scale = max(abs(want["squared_norm"]), abs(want["trace"]) / ROWS, 1.0)
    np.testing.assert_allclose(
      float(got[name]), want[name], rtol=rtol, atol=rtol * scale, err_msg=name
    )


def _windows(micro_batches, lengths):
  out, start = [], 0
  for n in lengths:
    out.append(micro_batches[start : start + n])
    start += n
  return out


def _expected_windows(params, windows, replicas=1):
  per = ROWS // replicas
  return [
    expected(
      [
        _unit_gradient(params, mb, slice(r * per, (r + 1) * per))
        for mb in window
        for r in range(replicas)
      ]
    )
    for window in windows
  ]


def _sgd0(**kwargs):
  """A learning rate of 0: every window is measured at the same params."""
  return optax_accum.MultiSteps(optax.sgd(0.0), noise_scale=True, **kwargs)


# -- the window's numbers on every path ---------------------------------------


def _via_update(opt, micro_batches, ends=None):
  params = _params()

  @jax.jit
  def call(state, batch, end):
    (_, weight), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    _, state = opt.update(grads, state, params, weight=weight, end_window=end)
    return state

  state, seen = opt.init(params), []
  for i, mb in enumerate(micro_batches):
    state = call(state, mb, False if ends is None else ends[i])
    if bool(state.updated):
      seen.append(optax_accum.get_last_window(state)["noise_scale"])
  return seen


def test_multi_steps_update_in_a_users_jit_measures_each_window():
  micro_batches = _micro_batches(3 * K, empty=(5,))
  seen = _via_update(_sgd0(every_k_schedule=K), micro_batches)
  want = _expected_windows(_params(), _windows(micro_batches, [K] * 3))
  assert len(seen) == 3 and want[1]["units"] == K - 1  # Weight 0 is no unit.
  for got, w in zip(seen, want, strict=True):
    _close(got, w)


def test_variable_windows_and_end_window():
  micro_batches = _micro_batches(9, seed=2)
  lengths = [2, 3, 4]  # every_k_schedule: 2 + the update count.
  seen = _via_update(_sgd0(every_k_schedule=lambda n: 2 + n), micro_batches)
  want = _expected_windows(_params(), _windows(micro_batches, lengths))
  for got, w in zip(seen, want, strict=True):
    _close(got, w)
  ends = [False, False, True, False, True, False, False, False, True]
  seen = _via_update(_sgd0(every_k_schedule="end_window"), micro_batches, ends)
  want = _expected_windows(_params(), _windows(micro_batches, [3, 2, 4]))
  for got, w in zip(seen, want, strict=True):
    _close(got, w)


def test_a_window_of_one_unit_measures_nothing():
  seen = _via_update(_sgd0(every_k_schedule=1), _micro_batches(2))
  assert [float(s["units"]) for s in seen] == [1.0, 1.0]
  assert all(float(s["trace"]) == float(s["squared_norm"]) == 0 for s in seen)


@pytest.mark.parametrize("policy", ["skip_window", "skip_micro_batch"])
def test_a_nonfinite_window_is_skipped_and_not_counted(policy):
  micro_batches = _micro_batches(3 * K, seed=3)
  micro_batches[K + 1] = {**micro_batches[K + 1], "y": np.full((ROWS, OUT), np.nan)}
  opt = _sgd0(every_k_schedule=K, on_nonfinite=policy)
  step = optax_accum.make_train_step(loss_fn, opt, donate=False)
  params, state, metrics = _params(), opt.init(_params()), []
  for mb in micro_batches:
    params, state, m = step(params, state, mb)
    metrics.append(m)
  ends = [m["noise_scale"] for m in metrics[K - 1 :: K]]
  windows = _windows(micro_batches, [K] * 3)
  if policy == "skip_window":  # The window applies nothing: units 0, zeros.
    assert int(metrics[-1]["skipped_windows"]) == 1
    assert {k: float(v) for k, v in ends[1].items()} == dict.fromkeys(ends[1], 0.0)
  else:  # The micro-batch alone is dropped: the window measures the others.
    del windows[1][1]
    _close(ends[1], _expected_windows(_params(), windows[1:2])[0])
  for i in (0, 2):
    _close(ends[i], _expected_windows(_params(), windows[i : i + 1])[0])
  inside = [m["noise_scale"] for i, m in enumerate(metrics) if (i + 1) % K]
  assert all(float(m["units"]) == 0 for m in inside)  # No window ended there.


@pytest.mark.parametrize("init", ["opt.init", "step.init"])
def test_the_streaming_step_measures_each_window(init):
  micro_batches = _micro_batches(2 * K, seed=4)
  opt = _sgd0(every_k_schedule=K)
  step = optax_accum.make_train_step(loss_fn, opt)
  params = _params()
  state = opt.init(params) if init == "opt.init" else step.init(params)
  seen = []
  for mb in micro_batches:
    params, state, metrics = step(params, state, mb)
    if bool(metrics["updated"]):
      seen.append(metrics["noise_scale"])
  for got, w in zip(
    seen, _expected_windows(_params(), _windows(micro_batches, [K, K])), strict=True
  ):
    _close(got, w)


def test_scan_mode_and_the_users_lax_scan_measure_each_window():
  micro_batches = _micro_batches(2 * K, seed=5)
  want = _expected_windows(_params(), _windows(micro_batches, [K, K]))
  stacked = [
    jax.tree.map(lambda *x: np.stack(x), *micro_batches[i : i + K]) for i in (0, K)
  ]
  step = optax_accum.make_train_step(loss_fn, optax.sgd(0.0), mode="scan")
  step = optax_accum.make_train_step(
    loss_fn, step.optimizer.replace(noise_scale=True), mode="scan"
  )
  params = _params()
  state = step.init(params)
  for window, w in zip(stacked, want, strict=True):
    params, state, metrics = step(params, state, window)
    _close(metrics["noise_scale"], w)
  # The streaming step inside the user's own lax.scan over a window.
  stream = optax_accum.make_train_step(loss_fn, _sgd0(every_k_schedule=K), donate=False)

  @jax.jit
  def window(params, state, batches):
    def body(carry, mb):
      p, s = carry
      p, s, m = stream(p, s, mb)
      return (p, s), m["noise_scale"]

    return jax.lax.scan(body, (params, state), batches)[1]

  params = _params()
  measured = window(params, stream.optimizer.init(params), stacked[1])
  _close(jax.tree.map(lambda x: x[-1], measured), want[1])


# -- over replicas: each replica's micro-batch is a unit ----------------------


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_the_step_with_axis_name_counts_each_replica_as_a_unit():
  mesh = _mesh()
  micro_batches = _micro_batches(2 * K, seed=6)
  want = _expected_windows(_params(), _windows(micro_batches, [K, K]), replicas=8)
  opt = _sgd0(every_k_schedule=K)
  step = optax_accum.make_train_step(loss_fn, opt, axis_name="data")
  rows = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    state, seen = step.init(params), []
    for mb in micro_batches:
      params, state, metrics = step(params, state, jax.device_put(mb, rows))
      if bool(metrics["updated"]):
        seen.append(metrics["noise_scale"])
  assert [float(s["units"]) for s in seen] == [w["units"] for w in want]
  for got, w in zip(seen, want, strict=True):
    _close(got, w)


def test_multi_steps_update_in_shard_map_adds_no_collective():
  """Each replica's squared norm is summed with its weight: the compiled
  micro-step holds as many all-reduces as without the measurement."""
  mesh = jax.make_mesh((8,), ("data",))
  micro_batches = _micro_batches(K, seed=7)
  want = _expected_windows(_params(), [micro_batches], replicas=8)[0]
  micro_batches = jax.device_put(micro_batches, NamedSharding(mesh, P("data")))

  def program(opt):
    def micro_step(params, state, batch):
      params = jax.lax.pcast(params, "data", to="varying")
      (_, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
      _, state = opt.update(grads, state, params, weight=n)
      return state

    specs = (P(), P(), P("data"))
    return jax.jit(jax.shard_map(micro_step, mesh=mesh, in_specs=specs, out_specs=P()))

  measured = _sgd0(every_k_schedule=K, axis_name="data")
  plain = measured.replace(noise_scale=False)
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = measured.init(params)
  run = program(measured)
  for mb in micro_batches:
    state = run(params, state, mb)
  _close(optax_accum.get_last_window(state)["noise_scale"], want)
  args = (params, plain.init(params), micro_batches[0])
  texts = [
    program(o).lower(*a).compile().as_text()
    for o, a in ((plain, args), (measured, (params, state, micro_batches[0])))
  ]
  counts = [t.count(" all-reduce(") + t.count(" all-reduce-start(") for t in texts]
  assert counts[0] == counts[1] > 0, counts

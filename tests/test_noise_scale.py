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


def test_a_logger_that_smooths_every_micro_step_counts_each_window_once():
  """Issue 60: ``get_last_window``'s estimates fed to ``smooth_noise_scale`` on
  every micro-step counted each window k times (B_simple 887 for 37)."""
  opt, params = _sgd0(every_k_schedule=K), _params()
  micro_batches = _micro_batches(3 * K, seed=3)

  @jax.jit
  def call(state, batch):
    (_, weight), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    return opt.update(grads, state, params, weight=weight)[1]

  state, every, ends = opt.init(params), None, None
  for mb in micro_batches:
    state = call(state, mb)
    measured = optax_accum.get_last_window(state)["noise_scale"]
    b_every, every = optax_accum.smooth_noise_scale(measured, every)
    if bool(state.updated):
      b_ends, ends = optax_accum.smooth_noise_scale(measured, ends)
  assert float(b_every) == float(b_ends) and float(ends.total) > 0


def test_multi_steps_update_in_a_users_jit_measures_each_window():
  micro_batches = _micro_batches(3 * K, empty=(5,))
  seen = _via_update(_sgd0(every_k_schedule=K), micro_batches)
  want = _expected_windows(_params(), _windows(micro_batches, [K] * 3))
  assert len(seen) == 3 and float(seen[1]["units"]) == K - 1  # Weight 0: no unit.
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
  # The step's micro-step keeps its reductions: each replica's squared norm
  # travels in its weight's psum. Counted in the lowered program, before XLA
  # combines all-reduces (which would hide one more).
  plain = optax_accum.make_train_step(
    loss_fn, opt.replace(noise_scale=False), axis_name="data"
  )
  counts = []
  with jax.set_mesh(mesh):
    for s in (plain, step):
      lowered = s.lower(
        params, s.init(params), jax.device_put(mb, rows), program="accumulate"
      )
      counts.append(lowered.as_text().count("stablehlo.all_reduce"))
  assert counts[0] == counts[1] > 0, counts


def test_multi_steps_update_in_shard_map_adds_no_collective():
  """Each replica's squared norm is summed with its weight: the lowered
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
    program(o).lower(*a).as_text()
    for o, a in ((plain, args), (measured, (params, state, micro_batches[0])))
  ]
  counts = [t.count("stablehlo.all_reduce") for t in texts]
  assert counts[0] == counts[1] > 0, counts


# -- statistics of many windows -----------------------------------------------


def _within_error(estimates, truth, what, z=4.0):
  """The mean of ``estimates`` within ``z`` standard errors of ``truth``."""
  estimates = np.asarray(estimates, np.float64)
  error = estimates.std(ddof=1) / np.sqrt(len(estimates))
  assert abs(estimates.mean() - truth) <= z * error, (
    what,
    estimates.mean(),
    truth,
    error,
  )


@pytest.mark.parametrize("weights", [(4, 4, 4, 4), (1, 3, 7, 2)])
def test_synthetic_gradients_of_known_covariance(weights):
  """Unit ``i`` draws ``N(mu, Sigma / w_i)``: the mean of the estimates is
  the truth, and their variance what docs/noise_scale.md derives."""
  d, windows, k = 6, 4000, len(weights)
  rng = np.random.default_rng(0)
  mu = rng.normal(size=d) * 0.5
  lam = rng.uniform(0.5, 3.0, size=d)  # Sigma's eigenvalues (diagonal).
  w = np.tile(np.asarray(weights, np.float64), windows)
  z = rng.normal(size=(windows * k, d))
  grads = jnp.asarray(mu + z * np.sqrt(lam / w[:, None]), jnp.float32)
  opt = _sgd0(every_k_schedule=k)

  @jax.jit
  def run(grads, weights):
    def body(state, xs):
      _, state = opt.update(xs[0], state, weight=xs[1])
      return state, (state.noise_scale.squared_norm, state.noise_scale.trace)

    return jax.lax.scan(body, opt.init(jnp.zeros(d)), (grads, weights))[1]

  squared, trace = (
    np.asarray(x)[k - 1 :: k] for x in run(grads, jnp.asarray(w, jnp.float32))
  )
  total = float(sum(weights))
  _within_error(trace, lam.sum(), "trace")
  _within_error(squared, mu @ mu, "squared_norm")
  var_trace = 2 * (lam**2).sum() / (k - 1)
  var_squared = (
    2 * (lam**2).sum() * k / ((k - 1) * total**2) + 4 * mu @ (lam * mu) / total
  )
  np.testing.assert_allclose(trace.var(ddof=1), var_trace, rtol=0.15)
  np.testing.assert_allclose(squared.var(ddof=1), var_squared, rtol=0.15)


POOL, HIDDEN, SLOTS = 48, 4, 8


def _mlp_params():
  rng = np.random.default_rng(2)
  return {
    "w1": jnp.asarray(rng.normal(size=(IN, HIDDEN)), jnp.float32),
    "b1": jnp.zeros(HIDDEN, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(HIDDEN, 1)) / 2, jnp.float32),
  }


def _example_loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return ((h @ params["w2"])[0] - y) ** 2


def mlp_loss(params, batch):
  losses = jax.vmap(_example_loss, (None, 0, 0))(params, batch["x"], batch["y"])
  n = batch["mask"].sum()
  return (batch["mask"] * losses).sum() / jnp.maximum(n, 1), n


def _pool():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(POOL, IN)).astype(np.float32)
  y = (np.sin(x.sum(1)) + rng.normal(size=POOL)).astype(np.float32)
  return x, y


def _direct(params):
  """|mu|^2 and tr(Sigma) of the pool's per-example gradients (float64)."""
  x, y = _pool()
  per_example = jax.vmap(jax.grad(_example_loss), (None, 0, 0))(params, x, y)
  flat = np.concatenate(
    [np.asarray(g, np.float64).reshape(POOL, -1) for g in jax.tree.leaves(per_example)],
    axis=1,
  )
  mean = flat.mean(0)
  return mean @ mean, ((flat - mean) ** 2).sum(1).mean()


def _drawn_window(rng, k, units, equal):
  """``k`` micro-batches of ``units`` units each (SLOTS rows a unit), rows
  drawn with replacement from the pool, each unit with its own count of
  valid rows."""
  x, y = _pool()
  rows = units * SLOTS
  index = rng.integers(POOL, size=(k, rows))
  counts = np.full((k, units), 4) if equal else rng.integers(1, SLOTS + 1, (k, units))
  mask = (np.arange(SLOTS)[None, None, :] < counts[..., None]).reshape(k, rows)
  return {"x": x[index], "y": y[index], "mask": mask.astype(np.float32)}


@pytest.mark.parametrize(
  "equal",
  [True, False],
  ids=["equal", "unequal"],
)
@pytest.mark.parametrize("devices", [1, 8])
def test_against_per_example_gradients(devices, equal):
  """Rows drawn at random from a pool: the mean of the windows' estimates is
  the pool's |mu|^2 and tr(Sigma) from ``jax.vmap(jax.grad)``, within its
  Monte-Carlo error; on 8 devices each replica's rows are a unit."""
  params = _mlp_params()
  squared, trace = _direct(params)
  windows, k = (1200, 4) if devices == 1 else (300, 2)
  optimizer = optax_accum.MultiSteps(optax.sgd(0.0), 1, noise_scale=True)
  rng = np.random.default_rng(4)
  if devices == 1:
    step = optax_accum.make_train_step(mlp_loss, optimizer, mode="scan")
    put = lambda tree: tree  # noqa: E731
  else:
    mesh = _mesh()
    step = optax_accum.make_train_step(
      mlp_loss, optimizer, mode="scan", axis_name="data"
    )
    params = jax.device_put(params, NamedSharding(mesh, P()))
    put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(None, "data")))  # noqa: E731
  state, seen = step.init(params), []
  for _ in range(windows):
    params, state, metrics = step(
      params, state, put(_drawn_window(rng, k, devices, equal))
    )
    # Read each window: XLA:CPU's 8 simulated devices on 2 cores abort with a
    # rendezvous timeout when hundreds of collective programs are queued (a
    # hand-written shard_map psum loop too).
    seen.append(jax.device_get(metrics["noise_scale"]))
  assert {float(s["units"]) for s in seen} == {float(k * devices)}
  _within_error([s["trace"] for s in seen], trace, "trace")
  _within_error([s["squared_norm"] for s in seen], squared, "squared_norm")


# -- policies, checkpoints and cost -------------------------------------------


def test_what_cannot_be_measured_is_refused():
  with pytest.raises(ValueError, match="with loss terms"):
    _sgd0(every_k_schedule=2, terms=("a", "b"))
  with pytest.raises(ValueError, match="`noise_scale` must be a bool"):
    _sgd0(every_k_schedule=2).replace(noise_scale="yes")
  coupled = optax_accum.CoupledLoss(lambda p, b: b, lambda z, b: (z.sum(), 1.0))
  with pytest.raises(ValueError, match="A CoupledLoss cannot measure the noise"):
    optax_accum.make_train_step(coupled, _sgd0(every_k_schedule=2), mode="scan")
  plain = optax_accum.MultiSteps(optax.sgd(0.0), 2).init(_params())
  with pytest.raises(ValueError, match=r"has no noise_scale field.*state._replace"):
    _sgd0(every_k_schedule=2).update(_params(), plain, weight=1.0)


def test_a_gradient_summed_over_replicas_already_is_refused():
  """Under shard_map with check_vma, params that enter replicated get
  gradients JAX summed already: no replica's own gradient is left to
  measure."""
  mesh = jax.make_mesh((8,), ("data",))
  opt = _sgd0(every_k_schedule=2, axis_name="data", grad_reduction="sum")

  def micro_step(params, state, batch):
    (_, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    return opt.update(grads, state, params, weight=n)[1]

  run = jax.shard_map(
    micro_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()
  )
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  batch = jax.device_put(_micro_batches(1)[0], NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match=r"leaf \['b'\] is summed over mesh axis 'data'"):
    jax.jit(run)(params, opt.init(params), batch)


def test_a_mid_window_checkpoint_resumes_the_measurement(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  micro_batches = _micro_batches(2 * K, seed=8)
  opt = _sgd0(every_k_schedule=K)
  step = optax_accum.make_train_step(loss_fn, opt)
  params = _params()
  state = step.init(params)
  for mb in micro_batches[: K + 2]:
    params, state, _ = step(params, state, mb)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt": state})
  checkpointer.wait_until_finished()
  fresh = _params()
  target = {"params": fresh, "opt": step.init(fresh)}
  restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target)
  params, state = restored["params"], restored["opt"]
  for mb in micro_batches[K + 2 :]:
    params, state, metrics = step(params, state, mb)
  want = _expected_windows(_params(), [micro_batches[K:]])[0]
  _close(metrics["noise_scale"], want)


def test_the_measurement_costs_one_squared_norm_a_micro_step():
  """Off, the program is the one without the feature (its FLOPs are
  tests/test_program_costs.py's); on, the compiled micro-step adds at most
  one squared norm of the gradient (2 FLOPs an element) and a few scalars."""
  params = {f"w{i}": jnp.ones((64, 32), jnp.float32) for i in range(4)}
  size = sum(p.size for p in jax.tree.leaves(params))

  def flops(opt):
    def micro_step(grads, state):
      return opt.update(grads, state, params, weight=3.0)

    lowered = jax.jit(micro_step).lower(params, opt.init(params))
    return lowered.compile().cost_analysis()["flops"]

  off = flops(optax_accum.MultiSteps(optax.adamw(1e-3), K))
  on = flops(optax_accum.MultiSteps(optax.adamw(1e-3), K, noise_scale=True))
  assert 0 < on - off <= 2 * size + 100, (off, on, size)


# -- layouts, sharded params and the inner optimizer's own state -----------------


def _many_leaves():
  """20 small leaves of one shape: on XLA:CPU the norm sums their squares
  in groups (``_backend.norm_groups``)."""
  rng = np.random.default_rng(9)
  return {
    f"w{i:02d}": jnp.asarray(rng.normal(size=(IN,)), jnp.float32) for i in range(20)
  }


def many_loss(params, batch):
  w = sum(params.values())
  err = batch["x"] @ w - batch["y"][:, 0]
  n = batch["mask"].sum()
  return (batch["mask"] * err**2).sum() / jnp.maximum(n, 1), n


def test_many_small_leaves_measure_as_one_vector():
  """20 small leaves, their squares summed in groups where the backend
  groups the norm: the same estimates as float64 ones from each
  micro-batch's own gradient, flattened into one vector."""
  micro_batches = _micro_batches(2 * K, seed=10)
  opt = _sgd0(every_k_schedule=K)
  step = optax_accum.make_train_step(many_loss, opt)
  params = _many_leaves()
  state = step.init(params)
  seen = []
  for mb in micro_batches:
    params, state, metrics = step(params, state, mb)
    if bool(metrics["updated"]):
      seen.append(metrics["noise_scale"])

  def unit(mb):
    (_, n), g = jax.value_and_grad(many_loss, has_aux=True)(_many_leaves(), mb)
    flat = np.concatenate(
      [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)]
    )
    return flat, float(n)

  windows = _windows(micro_batches, [K, K])
  for got, window in zip(seen, windows, strict=True):
    _close(got, expected([unit(mb) for mb in window]), rtol=1e-4)


def test_scan_mode_from_the_inner_optimizers_own_state_on_a_mesh():
  mesh = _mesh()
  micro_batches = _micro_batches(K, seed=11)
  want = _expected_windows(_params(), [micro_batches], replicas=8)[0]
  tx = optax.sgd(0.0)
  step = optax_accum.make_train_step(
    loss_fn,
    optax_accum.MultiSteps(tx, 1, noise_scale=True),
    mode="scan",
    axis_name="data",
  )
  window = jax.tree.map(lambda *x: np.stack(x), *micro_batches)
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    window = jax.device_put(window, NamedSharding(mesh, P(None, "data")))
    _, _, metrics = step(params, tx.init(params), window)
  _close(metrics["noise_scale"], want)


def test_params_split_over_a_model_axis_are_one_unit_a_replica():
  """In shard_map on a data x model mesh, each replica's gradient is split
  over the model axis: its squared norm is summed over the shards."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  micro_batches = _micro_batches(K, seed=12)
  want = _expected_windows(_params(), [micro_batches], replicas=4)[0]
  opt = _sgd0(every_k_schedule=K, axis_name="data")

  def sharded_loss(params, batch):
    err = batch["x"] @ params["w"] + params["b"][None] - batch["y"]
    n = batch["mask"].sum()
    total = jax.lax.psum((batch["mask"] * (err**2).sum(-1)).sum(), "model")
    return total / jnp.maximum(n, 1), n

  def micro_step(params, state, batch):
    params = jax.lax.pcast(params, "data", to="varying")
    (_, n), grads = jax.value_and_grad(sharded_loss, has_aux=True)(params, batch)
    return opt.update(grads, state, params, weight=n)[1]

  param_specs = {"w": P(None, "model"), "b": P("model")}
  batch_specs = {"x": P("data"), "y": P("data", "model"), "mask": P("data")}
  params = jax.device_put(
    _params(), jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs)
  )
  state = opt.init(params)
  state_specs = jax.tree.map(lambda _: P(), state)._replace(acc_grads=param_specs)
  run = jax.jit(
    jax.shard_map(
      micro_step,
      mesh=mesh,
      in_specs=(param_specs, state_specs, batch_specs),
      out_specs=state_specs,
    )
  )
  for mb in micro_batches:
    state = run(
      params,
      state,
      jax.device_put(mb, jax.tree.map(lambda s: NamedSharding(mesh, s), batch_specs)),
    )
  _close(optax_accum.get_last_window(state)["noise_scale"], want)


def test_an_accumulator_that_does_not_measure_leaves_the_field_alone():
  """The accumulator's setting decides: a state that measures, given to one
  built without noise_scale, keeps its last measurement untouched."""
  micro_batches = _micro_batches(2 * K, seed=13)
  measured = _sgd0(every_k_schedule=K)
  plain = measured.replace(noise_scale=False)
  params = _params()
  state = measured.init(params)
  update = jax.jit(
    lambda o, g, s, w: o.update(g, s, params, weight=w)[1], static_argnums=0
  )
  for opt, window in ((measured, micro_batches[:K]), (plain, micro_batches[K:])):
    for mb in window:
      (_, n), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
      state = update(opt, g, state, n)
  want = _expected_windows(_params(), [micro_batches[:K]])[0]
  _close(optax_accum.get_last_window(state)["noise_scale"], want)
  assert float(state.noise_scale.acc_units) == 0


def test_a_release_0_1_0_flax_state_dict_restores_with_the_field_added():
  """flax.serialization reads a named tuple's fields: a state dict saved
  before the field existed restores once ``noise_scale`` is added as None
  (docs/noise_scale.md), and a measuring state round-trips."""
  serialization = pytest.importorskip("flax.serialization")
  state = optax_accum.MultiSteps(optax.sgd(0.1), 2).init(_params())
  old = serialization.to_state_dict(state)
  del old["noise_scale"]  # As release 0.1.0 wrote it.
  with pytest.raises(ValueError, match="field names"):
    serialization.from_state_dict(state, old)
  restored = serialization.from_state_dict(state, {**old, "noise_scale": None})
  assert restored.noise_scale is None
  measured = _sgd0(every_k_schedule=2).init(_params())
  back = serialization.from_bytes(measured, serialization.to_bytes(measured))
  assert isinstance(back.noise_scale, optax_accum.NoiseScaleState)


# -- a public trainer's estimator, ported ------------------------------------


def _k_diffusion_estimates(per_replica, n_small, n_large):
  """k-diffusion's gradient noise scale (``k_diffusion/gns.py``, used by its
  ``train.py`` under DDP), ported: a hook takes each replica's squared norm
  and averages them over replicas, then the squared norm of the averaged
  gradient (what DDP applies); McCandlish et al.'s equal-size formulas follow
  with the per-device batch size as ``n_small`` and the global one as
  ``n_large``."""
  small = np.mean([g @ g for g in per_replica])
  mean = np.mean(per_replica, axis=0)
  large = mean @ mean
  squared = (n_large * large - n_small * small) / (n_large - n_small)
  trace = (small - large) / (1 / n_small - 1 / n_large)
  return squared, trace


@jax.jit
def _replica_gradients(params, window):
  """Each replica's own mean gradient (its rows of the one micro-batch),
  flattened: ``[replicas, params]``."""
  rows = jax.tree.map(lambda x: x[0].reshape(8, SLOTS, *x.shape[2:]), window)
  grads = jax.vmap(jax.grad(lambda p, r: mlp_loss(p, r)[0]), (None, 0))(params, rows)
  return jnp.concatenate([g.reshape(8, -1) for g in jax.tree.leaves(grads)], axis=1)


@pytest.mark.parametrize("equal", [True, False], ids=["equal", "padded"])
def test_k_diffusions_estimator_ported(equal):
  """On 8 replicas of equal batches k-diffusion's estimates are the step's,
  step by step. With padding (each replica a different count of valid rows,
  the per-device batch size still passed as ``n_small``) theirs miss the
  pool's |mu|^2 and tr(Sigma) by many standard errors; the step's do not."""
  mesh = _mesh()
  params = jax.device_put(_mlp_params(), NamedSharding(mesh, P()))
  optimizer = optax_accum.MultiSteps(optax.sgd(0.0), 1, noise_scale=True)
  step = optax_accum.make_train_step(mlp_loss, optimizer, mode="scan", axis_name="data")
  state, rng = step.init(params), np.random.default_rng(14)
  ours, theirs = [], []
  for _ in range(8 if equal else 300):
    window = _drawn_window(rng, 1, 8, equal)
    params, state, metrics = step(
      params, state, jax.device_put(window, NamedSharding(mesh, P(None, "data")))
    )
    ours.append(jax.device_get(metrics["noise_scale"]))
    sizes = (4, 32) if equal else (SLOTS, 8 * SLOTS)  # The per-device batch passed.
    per_replica = np.asarray(_replica_gradients(_mlp_params(), window), np.float64)
    theirs.append(_k_diffusion_estimates(per_replica, *sizes))
  if equal:  # 4 valid rows a replica: the equal-size case they assume.
    for got, (squared, trace) in zip(ours, theirs, strict=True):
      want = {"squared_norm": squared, "trace": trace, "units": 8.0}
      _close(got, want, rtol=1e-3)
    return
  squared, trace = _direct(_mlp_params())
  _within_error([o["trace"] for o in ours], trace, "trace")
  _within_error([o["squared_norm"] for o in ours], squared, "squared_norm")
  their_trace = np.asarray([t[1] for t in theirs])
  error = their_trace.std(ddof=1) / np.sqrt(len(their_trace))
  # Seen: 32.7 against 12.0, 20 standard errors off.
  assert abs(their_trace.mean() - trace) > 6 * error, (their_trace.mean(), trace)

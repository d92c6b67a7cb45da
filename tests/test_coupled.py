"""Issue 50: losses that couple the window's micro-batches, exact in two passes.

The oracle is the whole batch: a symmetric InfoNCE loss (CLIP) and a
Switch-style balance loss over the window equal their whole-batch gradients,
float32 and float64, for k = 2, 4, 8 and micro-batches of uneven valid rows;
the per-micro-batch losses every trainer computes today are measured beside.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

ROWS, IMAGE, TEXT, DIM = 32, 6, 5, 4


def _clip_params(dtype):
  rng = np.random.default_rng(0)
  return {
    "image": jnp.asarray(rng.normal(size=(IMAGE, DIM)), dtype),
    "text": jnp.asarray(rng.normal(size=(TEXT, DIM)), dtype),
    "scale": jnp.asarray(1.5, dtype),
  }


def _clip_batch(dtype, seed=0):
  """Pairs, a fifth of them padding: micro-batches hold uneven valid rows."""
  rng = np.random.default_rng(seed)
  return {
    "image": jnp.asarray(rng.normal(size=(ROWS, IMAGE)), dtype),
    "text": jnp.asarray(rng.normal(size=(ROWS, TEXT)), dtype),
    "mask": jnp.asarray(rng.random(ROWS) < 0.8, dtype),
  }


def _unit(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def clip_represent(params, batch):
  return {
    "image": _unit(jnp.tanh(batch["image"] @ params["image"])),
    "text": _unit(jnp.tanh(batch["text"] @ params["text"])),
    "scale": jnp.broadcast_to(params["scale"], batch["mask"].shape),
  }


def info_nce(z, batch):
  """Symmetric InfoNCE over the valid pairs, their mean, and their count."""
  mask = batch["mask"]
  logits = jnp.exp(z["scale"][0]) * z["image"] @ z["text"].T
  logits = jnp.where(mask[None, :] > 0, logits, -1e9)  # Padding is no negative.
  labels = jnp.arange(mask.shape[0])
  i2t = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  t2i = optax.softmax_cross_entropy_with_integer_labels(
    jnp.where(mask[:, None] > 0, logits, -1e9).T, labels
  )
  n = mask.sum()
  return ((i2t + t2i) / 2 * mask).sum() / jnp.maximum(n, 1), n


CLIP = optax_accum.CoupledLoss(clip_represent, info_nce)


def _window_gradient(coupled, params, batch, k):
  """The gradient the step applies (SGD at rate 1: params moved by it)."""
  step = optax_accum.make_train_step(coupled, optax.sgd(1.0), mode="scan")
  window = optax_accum.split_micro_batches(batch, k)
  moved, _, metrics = step(jax.tree.map(jnp.copy, params), step.init(params), window)
  return jax.tree.map(jnp.subtract, params, moved), metrics


def _rel(a, b):
  diff = optax.tree.norm(jax.tree.map(jnp.subtract, a, b))
  return float(diff / optax.tree.norm(b))


def _naive_gradient(coupled, params, batch, k):
  """Every trainer's accumulation today: the loss per micro-batch, its
  gradients weighted by the valid rows."""
  grads, weights, grad = [], [], jax.jit(jax.grad(coupled.whole_batch))
  for i in range(k):
    micro = jax.tree.map(lambda x, i=i: x[i::k], batch)
    grads.append(grad(params, micro))
    weights.append(float(micro["mask"].sum()))
  total = sum(weights)
  return jax.tree.map(
    lambda *g: sum(w * x for w, x in zip(weights, g, strict=True)) / total, *grads
  )


def _equals_the_whole_batch(coupled, params, batch, k, x64):
  """Asserts the window's gradient is the whole batch's (1e-12 in float64,
  1e-5 in float32); returns that gradient and the window's metrics."""
  whole = jax.grad(coupled.whole_batch)(params, batch)
  window, metrics = _window_gradient(coupled, params, batch, k)
  assert _rel(window, whole) <= (1e-12 if x64 else 1e-5)
  return whole, metrics


@pytest.mark.parametrize(
  "k, x64",
  [
    (2, False),
    (2, True),
    (4, False),
    (4, True),
    (8, False),
    (8, True),
  ],
  ids=["2-float32", "2-float64", "4-float32", "4-float64", "8-float32", "8-float64"],
)
def test_info_nce_over_the_window_is_the_whole_batch_gradient(k, x64):
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = _clip_params(dtype), _clip_batch(dtype)
    whole, metrics = _equals_the_whole_batch(CLIP, params, batch, k, x64)
    loss, n = info_nce(clip_represent(params, batch), batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["weight"], n)
    if not x64:  # Per micro-batch, a row's negatives are its micro-batch's rows.
      assert _rel(_naive_gradient(CLIP, params, batch, k), whole) > 1e-2


# --- a mixture of experts with the Switch balance loss over the window ------------

EXPERTS, TOKENS, WIDTH = 4, 6, 5


def _moe_params(dtype):
  rng = np.random.default_rng(1)
  return {
    "router": jnp.asarray(rng.normal(size=(WIDTH, EXPERTS)), dtype),
    "experts": jnp.asarray(rng.normal(size=(EXPERTS, WIDTH)) / WIDTH, dtype),
  }


def _moe_batch(dtype, rows=16, seed=2):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, TOKENS + 1, (rows, 1))
  return {
    "x": jnp.asarray(rng.normal(size=(rows, TOKENS, WIDTH)), dtype),
    "y": jnp.asarray(rng.normal(size=(rows, TOKENS)), dtype),
    "mask": jnp.asarray(np.arange(TOKENS) < lengths, dtype),
  }


def router_probs(params, batch):
  return jax.nn.softmax(batch["x"] @ params["router"], axis=-1)


def switch_balance(probs, batch):
  """`E * sum_i f_i P_i` over the valid tokens: f_i the fraction routed to
  expert i (a constant for the gradient), P_i the mean router probability."""
  mask = batch["mask"][..., None]
  n = batch["mask"].sum()
  top = jax.nn.one_hot(jnp.argmax(probs, axis=-1), EXPERTS, dtype=probs.dtype)
  f = jax.lax.stop_gradient((top * mask).sum((0, 1)) / n)
  p = (probs * mask).sum((0, 1)) / n
  return 0.1 * EXPERTS * (f * p).sum(), n


def moe_loss(params, batch):
  """The model's own loss: top-1 expert's output against the target, a mean
  over the valid tokens."""
  probs = router_probs(params, batch)
  pick = jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS, dtype=probs.dtype)
  out = jnp.einsum("rte,ew,rtw->rt", pick * probs, params["experts"], batch["x"])
  n = batch["mask"].sum()
  return (((out - batch["y"]) ** 2) * batch["mask"]).sum() / n, n


MOE = optax_accum.CoupledLoss(router_probs, switch_balance, loss_fn=moe_loss)


@pytest.mark.parametrize(
  "k, x64",
  [(2, False), (2, True), (4, False), (4, True)],
  ids=["2-float32", "2-float64", "4-float32", "4-float64"],
)
def test_switch_balance_over_the_window_is_the_whole_batch_gradient(k, x64):
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = _moe_params(dtype), _moe_batch(dtype)
    whole, metrics = _equals_the_whole_batch(MOE, params, batch, k, x64)
    assert set(metrics["terms"]) == {"window", "examples"}
    if not x64:  # Per micro-batch: f from one micro-batch's tokens.
      assert _rel(_naive_gradient(MOE, params, batch, k), whole) > 1e-3


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize(
  "loss, axis_type",
  [("info_nce", "Explicit"), ("switch_balance", "Explicit"), ("info_nce", "Auto")],
)
def test_on_a_mesh_the_window_loss_sees_the_gathered_window(loss, axis_type):
  """Rows split over 8 devices: each device's rows alone would hold 1/8 of
  the negatives (of the tokens that set f); the window loss sees them all."""
  coupled, params, batch = (
    (CLIP, _clip_params(jnp.float32), _clip_batch(jnp.float32))
    if loss == "info_nce"
    else (MOE, _moe_params(jnp.float32), _moe_batch(jnp.float32))
  )
  whole = jax.grad(coupled.whole_batch)(params, batch)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(AxisType, axis_type),))
  with jax.set_mesh(mesh):
    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    window, _ = _window_gradient(coupled, params, batch, 2)
  assert _rel(jax.device_get(window), whole) <= 1e-5


# --- cost: XLA's figures ------------------------------------------------------------


def _towers(width=128, depth=2, rows=32, dim=32):
  """Two MLP towers large enough that they, not the toy loss, set the cost."""
  rng = np.random.default_rng(3)

  def tower():
    shapes = [(width, width)] * depth + [(width, dim)]
    return [jnp.asarray(rng.normal(size=s) / width**0.5, jnp.float32) for s in shapes]

  params = {"image": tower(), "text": tower(), "scale": jnp.float32(1.0)}
  batch = {
    "image": jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
    "text": jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
    "mask": jnp.ones(rows, jnp.float32),
  }

  def run(ws, x):
    for w in ws[:-1]:
      x = jax.nn.gelu(x @ w)
    return _unit(x @ ws[-1])

  def represent(params, batch):
    return {
      "image": run(params["image"], batch["image"]),
      "text": run(params["text"], batch["text"]),
      "scale": jnp.broadcast_to(params["scale"], batch["mask"].shape),
    }

  return optax_accum.CoupledLoss(represent, info_nce), params, batch


def _scratch(lowered):
  return lowered.compile().memory_analysis().temp_size_in_bytes


def test_two_passes_cost_one_forward_more_and_the_representations():
  """Issue 50's bounds, from XLA's figures: a window's FLOPs at most 1.4x
  plain accumulation's and a whole-window step's (one forward more: 4/3 of a
  forward and backward), and the window program's scratch no more than the
  plain step's plus the window's representations and cotangents."""
  from benchmarks.coupled import window_flops

  coupled, params, batch = _towers()
  window = optax_accum.split_micro_batches(batch, 4)
  flops = window_flops(coupled, params, window)
  assert flops["two_pass"] <= 1.4 * min(flops["plain"], flops["whole"]), flops
  step = optax_accum.make_train_step(coupled, optax.adamw(1e-3), mode="scan")
  both = _scratch(step.lower(params, step.init(params), window))

  def per_micro_batch(params, batch):
    return coupled.whole_batch(params, batch), batch["mask"].sum()

  plain_step = optax_accum.make_train_step(
    per_micro_batch, optax.adamw(1e-3), mode="scan"
  )
  plain = _scratch(plain_step.lower(params, plain_step.init(params), window))
  z = jax.eval_shape(coupled.represent, params, batch)
  z_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(z))
  assert both <= plain + 2 * z_bytes, (both, plain)


# --- streaming, and what MultiSteps adds --------------------------------------------


def test_a_streamed_window_holds_its_micro_batches_and_equals_the_whole_batch():
  """Streaming: the first k - 1 calls hold their micro-batches and return the
  state as given; the k-th runs both passes. `end_window=True` ends a short
  window, whose gradient is its own rows' whole-batch gradient."""
  k, params, batch = 4, _clip_params(jnp.float32), _clip_batch(jnp.float32)
  opt = optax_accum.MultiSteps(optax.sgd(1.0), k)
  step = optax_accum.make_train_step(CLIP, opt)
  state = step.init(params)
  moved = jax.tree.map(jnp.copy, params)
  micro = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
  for i, micro_batch in enumerate(micro):
    moved, state, metrics = step(moved, state, micro_batch)
    assert bool(metrics["updated"]) == (i == k - 1)
  whole = jax.grad(CLIP.whole_batch)(params, batch)
  assert _rel(jax.tree.map(jnp.subtract, params, moved), whole) <= 1e-5
  short = jax.tree.map(lambda *x: jnp.concatenate(x), *micro[:2])
  before = moved
  moved, state, metrics = step(jax.tree.map(jnp.copy, before), state, micro[0])
  moved, state, metrics = step(moved, state, micro[1], end_window=True)
  assert int(metrics["update_count"]) == 2
  expected = jax.grad(CLIP.whole_batch)(before, short)
  assert _rel(jax.tree.map(jnp.subtract, before, moved), expected) <= 1e-5


def test_a_non_finite_window_is_skipped_whole():
  """One NaN input: every micro-batch's cotangent depends on it, so the whole
  window is skipped (`skip_window`), counted, and the params kept."""
  params, batch = _clip_params(jnp.float32), _clip_batch(jnp.float32)
  batch["image"] = batch["image"].at[3, 0].set(jnp.nan)
  step = optax_accum.make_train_step(CLIP, optax.sgd(1.0), mode="scan")
  window = optax_accum.split_micro_batches(batch, 4)
  moved, _, metrics = step(jax.tree.map(jnp.copy, params), step.init(params), window)
  assert int(metrics["skipped_windows"]) == 1 and not bool(metrics["updated"])
  jax.tree.map(np.testing.assert_array_equal, moved, params)


def test_progress_schedule_and_a_restored_checkpoint_between_windows(tmp_path):
  """The learning rate counts updates (not micro-batches), and a state saved
  between windows and restored against step.init resumes bit-identically."""
  import orbax.checkpoint as ocp

  lr = optax_accum.progress_schedule(optax.linear_schedule(1e-2, 0.0, 4))
  opt = optax.inject_hyperparams(optax.adamw)(learning_rate=lr)
  step = optax_accum.make_train_step(CLIP, opt, mode="scan")
  params = _clip_params(jnp.float32)
  windows = [
    optax_accum.split_micro_batches(_clip_batch(jnp.float32, s), 4) for s in range(3)
  ]
  p, s = jax.tree.map(jnp.copy, params), step.init(params)
  rates = []
  for window in windows[:2]:
    p, s, metrics = step(p, s, window)
    rates.append(float(metrics["learning_rate"]))
  np.testing.assert_allclose(rates, [1e-2, 7.5e-3], rtol=1e-6)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
  ckpt.wait_until_finished()
  target = {"params": params, "opt_state": step.init(params)}
  restored = ckpt.restore(tmp_path / "ckpt", target)
  after, _, _ = step(p, s, windows[2])
  resumed, _, _ = step(restored["params"], restored["opt_state"], windows[2])
  jax.tree.map(np.testing.assert_array_equal, resumed, after)


# --- audit: F10 -----------------------------------------------------------------------


def _clip_loss(params, batch):
  return info_nce(clip_represent(params, batch), batch)


def _coupled_window_trainer(optimizer, k):
  """A trainer that takes whole windows, through the library's CoupledLoss."""
  step = optax_accum.make_train_step(CLIP, optimizer, mode="scan")

  def train_window(params, state, micro_batches):
    window = jax.tree.map(lambda *x: jnp.stack(x), *micro_batches)
    params, state, _ = step(params, state, window)
    return params, state

  return step.init, train_window


@pytest.mark.parametrize("setup", ["per micro-batch", "CoupledLoss"])
def test_audit_names_a_coupled_loss_taken_per_micro_batch(setup):
  """The usual step on InfoNCE is F10, with CoupledLoss as the fix; the
  two-pass window audited as a window-level trainer is not."""
  params, batch = _clip_params(jnp.float32), _clip_batch(jnp.float32)
  kwargs = {}
  if setup == "CoupledLoss":
    kwargs["accumulation"] = optax_accum.per_window(_coupled_window_trainer)
  report = optax_accum.audit(
    _clip_loss, optax.adamw(1e-2), params, batch, k=4, **kwargs
  )
  if setup == "per micro-batch":
    assert report.found() == {"F10"}, report
    assert "CoupledLoss" in report.verdicts["F10"].fix
  else:
    assert report.ok, report
    assert report.verdicts["F10"].status == "ok", report


def _dropout_represent(params, batch, key):
  """CLIP's embeddings after dropout on the image features."""
  keep = jax.random.bernoulli(key, 0.7, batch["image"].shape)
  dropped = {**batch, "image": jnp.where(keep, batch["image"] / 0.7, 0.0)}
  return clip_represent(params, dropped)


def test_both_passes_draw_the_same_dropout_masks():
  """With an `rng`, micro-batch i gets the step's key in both passes: the
  window's gradient is that of the window loss over those draws, exactly."""
  k, params, batch = 4, _clip_params(jnp.float32), _clip_batch(jnp.float32)
  coupled = optax_accum.CoupledLoss(_dropout_represent, info_nce)
  step = optax_accum.make_train_step(coupled, optax.sgd(1.0), mode="scan")
  window = optax_accum.split_micro_batches(batch, k)
  rng = jax.random.key(7)
  moved, _, _ = step(jax.tree.map(jnp.copy, params), step.init(params), window, rng)
  keys = [jax.random.fold_in(rng, i) for i in range(k)]  # The step's: n-th of the run.

  def drawn(params):
    micro = [jax.tree.map(lambda x, i=i: x[i], window) for i in range(k)]
    z = [_dropout_represent(params, m, key) for m, key in zip(micro, keys, strict=True)]
    joined = jax.tree.map(lambda *x: jnp.concatenate(x), *z)
    return info_nce(joined, jax.tree.map(lambda *x: jnp.concatenate(x), *micro))[0]

  expected = jax.grad(drawn)(params)
  assert _rel(jax.tree.map(jnp.subtract, params, moved), expected) <= 1e-5


# --- the float64 reference model, over every path a coupled loss runs on ------------

SCALE = 3.0


def _linear_represent(params, batch):
  return {
    "image": batch["image"] @ params["image"],
    "text": batch["text"] @ params["text"],
  }


def _linear_info_nce(z, batch):
  return info_nce({**z, "scale": jnp.full(batch["mask"].shape, np.log(SCALE))}, batch)


LINEAR = optax_accum.CoupledLoss(_linear_represent, _linear_info_nce)


def _run_windows(path, params, windows):
  """Each window's applied gradient (SGD at rate 1) along ``path``."""
  k = jax.tree.leaves(windows[0])[0].shape[0]
  if path == "stream":
    step = optax_accum.make_train_step(
      LINEAR, optax_accum.MultiSteps(optax.sgd(1.0), k)
    )
  else:
    step = optax_accum.make_train_step(LINEAR, optax.sgd(1.0), mode="scan")
  state = step.init(params)
  if path == "user_scan":  # Every window in your own lax.scan.

    def body(carry, window):
      p, s = carry
      moved, s, _ = step(p, s, window)
      return (moved, s), jax.tree.map(jnp.subtract, p, moved)

    stacked = jax.tree.map(lambda *x: jnp.stack(x), *windows)
    _, grads = jax.jit(lambda c, w: jax.lax.scan(body, c, w))((params, state), stacked)
    return [jax.tree.map(lambda g, i=i: g[i], grads) for i in range(len(windows))]
  run = jax.jit(step) if path == "user_jit" else step
  applied = []
  for window in windows:
    before = jax.tree.map(jnp.copy, params)  # The step donates what it is given.
    if path == "stream":
      for i in range(k):
        params, state, _ = step(
          params, state, jax.tree.map(lambda x, i=i: x[i], window)
        )
    else:
      params, state, _ = run(params, state, window)
    applied.append(jax.tree.map(jnp.subtract, before, params))
  return applied


@pytest.mark.parametrize(
  "path", ["scan", "stream", "user_jit", "user_scan", "explicit", "auto"]
)
def test_every_path_matches_the_float64_reference_model(path):
  """Two windows of drawn sizes and padding, float64, against
  `reference_model.coupled_window_gradient` (NumPy, from docs/coupled.md)."""
  import reference_model as ref

  if path in ("explicit", "auto") and jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  rng = np.random.default_rng(zlib.crc32(path.encode()))
  k = int(rng.choice([2, 4]))
  with jax.enable_x64(True):
    params = {
      "image": jnp.asarray(rng.normal(size=(IMAGE, DIM)) / 3, jnp.float64),
      "text": jnp.asarray(rng.normal(size=(TEXT, DIM)) / 3, jnp.float64),
    }
    batches = [
      _clip_batch(jnp.float64, seed=int(rng.integers(1 << 16))) for _ in range(2)
    ]
    windows = [optax_accum.split_micro_batches(b, k) for b in batches]
    current = jax.device_get(params)  # The step donates the params it is given.
    if path in ("explicit", "auto"):
      axis = AxisType.Explicit if path == "explicit" else AxisType.Auto
      mesh = jax.make_mesh((8,), ("data",), axis_types=(axis,))
      with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        spec = NamedSharding(mesh, P(None, "data"))
        applied = _run_windows(path, params, [jax.device_put(w, spec) for w in windows])
    else:
      applied = _run_windows(path, params, windows)
    for window, got in zip(windows, applied, strict=True):
      rows = jax.tree.map(lambda x: np.asarray(x).reshape(-1, *x.shape[2:]), window)
      want = ref.coupled_window_gradient(current, rows, SCALE)
      for name in want:
        np.testing.assert_allclose(
          np.asarray(got[name]), want[name], rtol=1e-12, atol=1e-14
        )
      current = {n: current[n] - want[n] for n in current}


# -- issue 60: a streamed window lives in the state --------------------------


def _streamed(step, params, state, micro_batches):
  for micro_batch in micro_batches:
    params, state, metrics = step(params, state, micro_batch)
  return params, state, metrics


def test_a_streamed_window_lives_in_the_state_restored_mid_window_or_interleaved():
  """The held micro-batches were in the step object: a mid-window checkpoint
  restored in the same process ended its window early (0.79 off), and two
  states through one step mixed their windows (1.32 off)."""
  k, params, batch = 4, _clip_params(jnp.float32), _clip_batch(jnp.float32)
  step = optax_accum.make_train_step(CLIP, optax.sgd(1.0), every_k_schedule=k)
  micro = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
  whole = jax.grad(CLIP.whole_batch)(params, batch)

  def moved_by(p):
    return jax.tree.map(jnp.subtract, params, p)

  start = jax.tree.map(jnp.copy, params), step.init(params)
  half_p, half_s, _ = _streamed(step, *start, micro[:2])
  saved = jax.tree.map(np.asarray, (half_p, half_s))  # The naive checkpoint.
  done, _, metrics = _streamed(step, half_p, half_s, micro[2:])
  assert bool(metrics["updated"]) and _rel(moved_by(done), whole) <= 1e-5
  restored = jax.tree.map(jnp.asarray, saved)
  again, _, metrics = _streamed(step, *restored, micro[2:])
  assert bool(metrics["updated"]) and _rel(moved_by(again), whole) <= 1e-5
  # Two runs interleaved through one step: each window its own.
  other = _clip_batch(jnp.float32, seed=1)
  other_micro = [jax.tree.map(lambda x, i=i: x[i::k], other) for i in range(k)]
  runs = [(jax.tree.map(jnp.copy, params), step.init(params)) for _ in range(2)]
  for pair in zip(micro, other_micro, strict=True):
    runs = [step(p, s, mb)[:2] for (p, s), mb in zip(runs, pair, strict=True)]
  assert _rel(moved_by(runs[0][0]), whole) <= 1e-5
  assert _rel(moved_by(runs[1][0]), jax.grad(CLIP.whole_batch)(params, other)) <= 1e-5


def test_a_loader_that_refills_one_buffer_trains_on_each_micro_batch():
  """The held micro-batches were the caller's arrays: a loader refilling one
  NumPy buffer trained on k copies of the last (1.68 off)."""
  k, params, batch = 4, _clip_params(jnp.float32), _clip_batch(jnp.float32)
  step = optax_accum.make_train_step(CLIP, optax.sgd(1.0), every_k_schedule=k)
  buffer = jax.tree.map(lambda x: np.zeros(x[::k].shape, x.dtype), batch)
  moved, state = jax.tree.map(jnp.copy, params), step.init(params)
  buffer["big"] = np.zeros((4, 2**20), np.float32)  # Refilled as its copy runs.
  for i in range(k):
    for name, x in batch.items():
      buffer[name][...] = np.asarray(x[i::k])  # Refilled in place.
    buffer["big"][...] = i
    moved, state, metrics = step(moved, state, buffer)
    buffer["big"][...] = -1.0
    if i < k - 1:
      held = state.held[-1]["big"]
      assert float(held.min()) == float(held.max()) == i
  whole = jax.grad(CLIP.whole_batch)(params, batch)
  assert bool(metrics["updated"])
  assert _rel(jax.tree.map(jnp.subtract, params, moved), whole) <= 1e-5


def test_a_held_window_is_refused_by_every_other_path_and_unlike_shapes_named():
  k, params, batch = 2, _clip_params(jnp.float32), _clip_batch(jnp.float32)
  opt = optax_accum.MultiSteps(optax.sgd(1.0), k)
  step = optax_accum.make_train_step(CLIP, opt)
  _, state, _ = step(params, step.init(params), batch)
  assert len(state.held) == 1
  scan = optax_accum.make_train_step(CLIP, opt, mode="scan")
  with pytest.raises(ValueError, match=r"holds 1 micro-batches.*a scan-mode step"):
    scan(params, state, optax_accum.split_micro_batches(batch, k))
  with pytest.raises(ValueError, match=r"holds 1 micro-batches.*MultiSteps.update"):
    step.optimizer.update(jax.tree.map(jnp.zeros_like, params), state, params)
  short = jax.tree.map(lambda x: x[:-2], batch)
  unlike = r"micro-batch 1 .* leaf \['image'\] of shape \(30, 6\)"
  with pytest.raises(ValueError, match=unlike):
    step(params, state, short)


def test_a_should_skip_update_fn_is_refused():
  """It rejected single micro-batches of a coupled window: a partial window
  (weight 12 of 16) was applied, 0.77 off."""
  opt = optax_accum.MultiSteps(
    optax.sgd(1.0), 4, should_skip_update_fn=lambda u, s, p: (False, ())
  )
  with pytest.raises(ValueError, match=r"no should_skip_update_fn"):
    optax_accum.make_train_step(CLIP, opt, mode="scan")


@pytest.mark.parametrize("k", [3, 7])
def test_a_windows_weight_is_exact(k):
  """``W / k`` summed k times read 7.0000005 for 7; a bfloat16 loss's weight
  was cast to bfloat16 (1,001 read 1,000)."""
  params = {"w": jnp.ones((2,), jnp.bfloat16)}

  def represent(p, batch):
    return {"z": batch["x"] @ p["w"][:, None]}

  def window_loss(z, batch):
    return jnp.mean(z["z"]).astype(jnp.bfloat16), batch["n"].sum() * 1001 // k

  coupled = optax_accum.CoupledLoss(represent, window_loss)
  step = optax_accum.make_train_step(coupled, optax.sgd(0.0), mode="scan")
  window = {"x": jnp.ones((k, 2, 2), jnp.bfloat16), "n": jnp.ones((k, 1), jnp.int32)}
  _, state, metrics = step(params, step.init(params), window)
  assert float(metrics["weight"]) == 1001.0
  assert float(state.last_window_weight) == 1001.0


# -- big_vision's SigLIP, ported as its trainer writes it ------------------------


def siglip_represent(params, batch):
  """The towers and big_vision's ``extras``: ``t`` and ``b`` are params of the
  loss, window-level leaves (no row axis)."""
  zimg = _unit(jnp.tanh(batch["image"] @ params["img"]))
  ztxt = _unit(jnp.tanh(batch["text"] @ params["txt"]))
  return zimg, ztxt, {"t": jnp.exp(params["t"]), "b": params["b"]}


def siglip_loss(z, batch):
  """big_vision's ``trainers/proj/image_text/siglip.py`` loss, line for line."""
  del batch
  zimg, ztxt, extras = z
  logits = jnp.dot(zimg, ztxt.T)
  logits = logits * extras["t"] + extras["b"]
  eye = jnp.eye(zimg.shape[0], dtype=logits.dtype)
  m1_diag1 = -jnp.ones_like(logits) + 2 * eye
  loglik = jax.nn.log_sigmoid(m1_diag1 * logits)
  nll = -jnp.sum(loglik, axis=-1)
  return jnp.mean(nll), zimg.shape[0]


SIGLIP = optax_accum.CoupledLoss(siglip_represent, siglip_loss)


def _siglip_params(dtype):
  rng = np.random.default_rng(1)
  return {
    "img": jnp.asarray(rng.normal(size=(IMAGE, DIM)), dtype),
    "txt": jnp.asarray(rng.normal(size=(TEXT, DIM)), dtype),
    "t": jnp.asarray(np.log(10.0), dtype),
    "b": jnp.asarray(-10.0, dtype),
  }


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_siglip_with_its_temperature_and_bias_as_params_is_the_whole_batch(x64):
  """Issue 60: a scalar leaf of ``represent`` crashed; ``t`` and ``b`` get the
  whole batch's gradient, streaming and in scan mode."""
  k, tol = 4, 1e-12 if x64 else 1e-5
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = _siglip_params(dtype), _clip_batch(dtype)
    whole = jax.grad(SIGLIP.whole_batch)(params, batch)
    assert float(jnp.abs(whole["t"])) > 0 and float(jnp.abs(whole["b"])) > 0
    window, _ = _window_gradient(SIGLIP, params, batch, k)
    assert _rel(window, whole) <= tol
    step = optax_accum.make_train_step(SIGLIP, optax.sgd(1.0), every_k_schedule=k)
    micro = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
    start = jax.tree.map(jnp.copy, params), step.init(params)
    moved, _, metrics = _streamed(step, *start, micro)
    assert bool(metrics["updated"])
    stacked = jax.tree.map(lambda *x: jnp.concatenate(x), *micro)  # Rows reordered.
    streamed_whole = jax.grad(SIGLIP.whole_batch)(params, stacked)
    assert _rel(jax.tree.map(jnp.subtract, params, moved), streamed_whole) <= tol


def test_whole_batch_takes_the_key_represent_takes():
  def represent(params, batch, key):
    noise = 1 + 0.1 * jax.random.normal(key, batch["image"].shape)
    return clip_represent(params, {**batch, "image": batch["image"] * noise})

  coupled = optax_accum.CoupledLoss(represent, info_nce)
  params, batch = _clip_params(jnp.float32), _clip_batch(jnp.float32)
  key = jax.random.key(0)
  loss = coupled.whole_batch(params, batch, key)
  assert float(loss) == float(info_nce(represent(params, batch, key), batch)[0])


# -- coupled losses under axis_name ---------------------------------------------


def _per_device(tree, devices=8):
  """A scan-mode window's rows split over ``devices``, the device axis first."""
  return jax.tree.map(
    lambda x: x.reshape(x.shape[0], devices, -1, *x.shape[2:]).swapaxes(0, 1), tree
  )


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_a_coupled_loss_under_axis_name_is_the_whole_batch(x64):
  """Issue 60: refused before. Each replica gathers the window's
  representations, takes its own rows' cotangents, and the step sums once:
  in your shard_map, through the step's axis_name under plain jit (scan mode
  and streaming), and in pmap (SigLIP, t and b included)."""
  k, tol = 2, 1e-12 if x64 else 1e-5
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = _siglip_params(dtype), _clip_batch(dtype)
    window = optax_accum.split_micro_batches(batch, k)
    whole = jax.grad(SIGLIP.whole_batch)(params, batch)
    step = optax_accum.make_train_step(
      SIGLIP, optax.sgd(1.0), mode="scan", axis_name="data", donate=False
    )
    state = step.init(params)
    mapped = jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), P(None, "data")), out_specs=P()
      )
    )
    moved = {"shard_map": mapped(params, state, window)}
    on_mesh = jax.device_put(window, NamedSharding(mesh, P(None, "data")))
    moved["axis_name"] = step(params, state, on_mesh)
    with jax.set_mesh(mesh):  # In your own jit, the mesh is the context's.
      moved["axis_name in jit"] = jax.jit(step)(params, state, on_mesh)
    pmapped = jax.pmap(step, axis_name="data", in_axes=(None, None, 0))
    moved["pmap"] = jax.tree.map(
      lambda x: x[0], pmapped(params, state, _per_device(window))
    )
    streamed = optax_accum.make_train_step(
      SIGLIP, optax.sgd(1.0), axis_name="data", donate=False, every_k_schedule=k
    )
    out = (params, streamed.init(params), None)
    for i in range(k):  # Each micro-batch held on the mesh; the window's end sums.
      rows = jax.tree.map(lambda x, i=i: x[i], window)
      out = streamed(*out[:2], jax.device_put(rows, NamedSharding(mesh, P("data"))))
    moved["stream, axis_name"] = out
    for name, (p, _, metrics) in moved.items():
      assert _rel(jax.tree.map(jnp.subtract, params, p), whole) <= tol, name
      assert float(metrics["weight"]) == ROWS, name
    if not x64:  # Without axis_name each replica's window would be its own.
      alone = optax_accum.make_train_step(SIGLIP, optax.sgd(1.0), mode="scan")
      mapped = jax.shard_map(
        alone, mesh=mesh, in_specs=(P(), P(), P(None, "data")), out_specs=P()
      )
      with pytest.raises(ValueError, match=r"train step runs under.*axis_name="):
        jax.jit(mapped)(params, state, window)


def test_the_coupled_steps_messages_name_the_cause():
  """Issue 60: a TrainState for params, a bare scalar window loss and a donated
  buffer reused gave Flax's, JAX's and XLA's raw errors."""
  from flax.training.train_state import TrainState

  params, batch = _clip_params(jnp.float32), _clip_batch(jnp.float32)
  window = optax_accum.split_micro_batches(batch, 2)
  step = optax_accum.make_train_step(CLIP, optax.sgd(0.1), mode="scan")
  whole = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"`params` is a TrainState"):
    step(whole, step.init(params), window)
  bare = optax_accum.CoupledLoss(clip_represent, lambda z, b: info_nce(z, b)[0])
  bare_step = optax_accum.make_train_step(bare, optax.sgd(0.1), mode="scan")
  with pytest.raises(
    ValueError, match=r"must return \(loss, weight\).*got float32\[\]"
  ):
    bare_step(params, bare_step.init(params), window)
  with pytest.raises(ValueError, match=r"batch leaf \['n'\] has no row axis"):
    step(params, step.init(params), {**window, "n": jnp.ones(2)})
  given = jax.tree.map(jnp.copy, params)
  state = step.init(given)
  step(given, state, window)
  with pytest.raises(ValueError, match=r"`params` leaf \['image'\] was deleted"):
    step(given, step.init(params), window)


def test_a_streamed_window_saved_mid_window_with_orbax_resumes(tmp_path):
  """The held micro-batches are in the checkpoint; ``resume_target`` builds
  the restore target from its metadata, and the window ends as it would
  have, bit for bit."""
  import orbax.checkpoint as ocp

  k, params, batch = 4, _clip_params(jnp.float32), _clip_batch(jnp.float32)
  step = optax_accum.make_train_step(CLIP, optax.adamw(1e-2), every_k_schedule=k)
  micro = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
  p, s, _ = _streamed(
    step, jax.tree.map(jnp.copy, params), step.init(params), micro[:3]
  )
  saver = ocp.StandardCheckpointer()
  saver.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
  saver.wait_until_finished()
  want = _streamed(step, p, s, micro[3:])[0]
  saved = saver.metadata(tmp_path / "ckpt").item_metadata["opt_state"]
  target = optax_accum.resume_target(step.init(params), saved)
  restored = saver.restore(tmp_path / "ckpt", {"params": params, "opt_state": target})
  assert len(restored["opt_state"].held) == 3
  got = _streamed(step, restored["params"], restored["opt_state"], micro[3:])[0]
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_window_of_tuples_restored_from_orbax_mid_window_resumes(tmp_path):
  """Orbax restores the held micro-batches' tuples as lists: the next call
  takes them in its own micro-batch's tree."""
  import orbax.checkpoint as ocp

  def represent(params, batch):
    x, mask = batch
    return clip_represent(params, {"image": x, "text": x[:, :TEXT], "mask": mask})

  def loss(z, batch):
    return info_nce(z, {"mask": batch[1]})

  coupled = optax_accum.CoupledLoss(represent, loss)
  step = optax_accum.make_train_step(coupled, optax.sgd(0.1), every_k_schedule=2)
  params, batch = _clip_params(jnp.float32), _clip_batch(jnp.float32)
  micro = [(batch["image"][i::2], batch["mask"][i::2]) for i in range(2)]
  p, s, _ = step(jax.tree.map(jnp.copy, params), step.init(params), micro[0])
  saver = ocp.StandardCheckpointer()
  saver.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
  saver.wait_until_finished()
  want = step(p, s, micro[1])[0]
  saved = saver.metadata(tmp_path / "ckpt").item_metadata["opt_state"]
  target = optax_accum.resume_target(step.init(params), saved)
  restored = saver.restore(tmp_path / "ckpt", {"params": params, "opt_state": target})
  got = step(restored["params"], restored["opt_state"], micro[1])[0]
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("loss_fn", [CLIP, lambda p, b: (0.0, 1.0)])
def test_an_unknown_mode_is_refused_for_every_loss(loss_fn):
  with pytest.raises(
    ValueError, match=r"`mode` must be 'stream' or 'scan', got 'window'"
  ):
    optax_accum.make_train_step(loss_fn, optax.sgd(1.0), mode="window")

"""Streaming without waiting: the host's memo of the counters, and O(1) Python per call.

The streaming step picks its program from counter values it remembers for the
state it returned last, instead of reading them from the device. These tests
drive it with random sequences (early window ends, skipped, empty and rejected
micro-batches, states restored from earlier or reused twice) and hold it to
the step traced inside ``jit``, which decides on the device, after every call.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum._step import _host

DIM = 3


def _loss(params, batch):
  """Token-mean squared error; ``reject`` shows up as the gradient of ``flag``."""
  pred = batch["x"] @ params["w"]
  errors = (pred - batch["y"]) ** 2 * batch["mask"][:, None]
  weight = batch["mask"].sum()
  loss = errors.sum() / jnp.maximum(weight, 1.0) + batch["reject"] * params["flag"]
  return loss, weight


def _reject_flagged(updates, gradient_step, params):
  del gradient_step, params
  return updates["flag"] > 0.5, ()


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, DIM * 2).reshape(DIM, 2), "flag": jnp.zeros(())}


def _batch(rng, rows=4):
  mask = (rng.random(rows) < 0.7).astype(np.float32)
  event = rng.random()
  if event < 0.15:
    mask[:] = 0.0  # All padding: weight 0.
  x = rng.normal(size=(rows, DIM)).astype(np.float32)
  if 0.15 <= event < 0.25:
    x[0, 0] = np.nan  # A non-finite gradient: the window is skipped.
  return {
    "x": x,
    "y": rng.normal(size=(rows, 2)).astype(np.float32),
    "mask": mask,
    "reject": np.float32(0.25 <= event < 0.35),
  }


CONFIGS = {
  "int k": dict(every_k_schedule=3),
  "k = 1": dict(every_k_schedule=1),
  "callable k": dict(every_k_schedule=lambda step: 1 + step % 3),
  "should_skip_update_fn": dict(
    every_k_schedule=2, should_skip_update_fn=_reject_flagged
  ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_memo_never_disagrees_with_the_device(config, seed, monkeypatch):
  reads = []
  host_int = _host._host_int
  monkeypatch.setattr(_host, "_host_int", lambda x: reads.append(1) or host_int(x))
  opt = optax_accum.MultiSteps(optax.adam(0.1), **CONFIGS[config])
  step = optax_accum.make_train_step(_loss, opt, donate=False)
  in_graph = jax.jit(
    lambda p, s, b, e: optax_accum.make_train_step(_loss, opt, donate=False)(
      p, s, b, end_window=e
    )
  )
  rng = np.random.default_rng(seed)
  params = _params()
  state = opt.init(params)
  saved = [(params, state)]
  misses = updates = windows = 0
  for call in range(60):
    event = rng.random()
    if event < 0.1:  # Restore an earlier checkpoint: new arrays, same values.
      params, state = jax.tree.map(jnp.array, saved[rng.integers(len(saved))])
    elif event < 0.2:  # Reuse an earlier state a second time.
      params, state = saved[-1 - rng.integers(min(3, len(saved)))]
    batch = _batch(rng)
    end_window = bool(rng.random() < 0.15)
    known = step._known
    hit = known is not None and known.returned(state)
    misses += not hit
    new_params, new_state, metrics = step(params, state, batch, end_window=end_window)
    want_params, want_state, want_metrics = in_graph(params, state, batch, end_window)
    for field in ("mini_step", "gradient_step", "updated", "skipped_windows"):
      assert int(getattr(new_state, field)) == int(getattr(want_state, field)), (
        call,
        field,
      )
    chex.assert_trees_all_close(new_params, want_params, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(new_state, want_state, rtol=1e-6, atol=1e-7)
    for name in ("loss", "weight", "updated", "update_count"):
      np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-6)
    known = step._known
    assert known.mini_step is new_state.mini_step
    assert known.gradient_step is new_state.gradient_step
    if known.value is not None:
      assert known.value == int(new_state.mini_step), call
    if known.k is not None:
      assert known.k == int(opt.k_at(new_state.gradient_step)), call
    updates += bool(metrics["updated"])
    windows += int(new_state.mini_step) == 0
    params, state = new_params, new_state
    saved.append((params, state))
  assert updates >= 5  # The sequences reach the update program many times.
  if config in ("int k", "k = 1"):
    assert len(reads) <= 2 * misses
  elif config == "callable k":
    assert len(reads) <= 2 * misses + windows  # At most once per window.
  else:  # Counting depends on the data: the counter is read on every call.
    assert len(reads) >= 60


def test_steady_state_reads_nothing_from_the_device(monkeypatch):
  reads = []
  host_int = _host._host_int
  monkeypatch.setattr(_host, "_host_int", lambda x: reads.append(1) or host_int(x))
  k = 4
  opt = optax_accum.MultiSteps(optax.adam(0.1), k)
  step = optax_accum.make_train_step(_loss, opt)
  rng = np.random.default_rng(0)
  params = _params()
  state = opt.init(params)
  params, state, _ = step(params, state, _batch(rng))
  first = len(reads)
  # The first call reads the micro-step count of a state it did not make; with a
  # constant k it needs no update count.
  assert first == 1
  for _ in range(3 * k):
    params, state, metrics = step(params, state, _batch(rng))
  assert len(reads) == first
  assert int(state.gradient_step) + int(metrics["skipped_windows"]) >= 2


def test_callable_k_reads_the_device_once_per_window(monkeypatch):
  reads = []
  host_int = _host._host_int
  monkeypatch.setattr(_host, "_host_int", lambda x: reads.append(1) or host_int(x))
  opt = optax_accum.MultiSteps(optax.sgd(0.1), lambda step: 2 + step % 2)
  step = optax_accum.make_train_step(_loss, opt)
  params = _params()
  state = opt.init(params)
  batch = {
    "x": np.ones((2, DIM), np.float32),
    "y": np.zeros((2, 2), np.float32),
    "mask": np.ones(2, np.float32),
    "reject": np.float32(0),
  }
  windows = 0
  for _ in range(10):  # Windows of 2, 3, 2, 3: 10 micro-batches.
    params, state, metrics = step(params, state, batch)
    windows += bool(metrics["updated"])
  assert windows == 4
  assert len(reads) == 2 + (windows - 1)  # First call: both; then once per window.


def _many_leaf_step(leaves):
  params = {f"w{i:04d}": jnp.full((2,), 0.1) for i in range(leaves)}

  def loss(params, batch):
    total = sum(p.sum() for p in params.values())
    return jnp.mean((batch["x"] * total - 1.0) ** 2), jnp.float32(2)

  opt = optax_accum.MultiSteps(optax.inject_hyperparams(optax.adam)(0.1), 3)
  return optax_accum.make_train_step(loss, opt), params, opt.init(params)


def test_steady_state_python_does_not_walk_the_trees(monkeypatch):
  """O(1) Python per call: no tree walk over params or state once warm."""
  step, params, state = _many_leaf_step(50)
  batch = {"x": np.ones(2, np.float32)}
  for _ in range(7):  # Warm: both programs compiled for the steady state's types.
    params, state, _ = step(params, state, batch)
  walks = []

  def counting(fn):
    return lambda *args, **kwargs: walks.append(fn.__name__) or fn(*args, **kwargs)

  for name in ("leaves", "map", "flatten", "structure"):
    monkeypatch.setattr(jax.tree, name, counting(getattr(jax.tree, name)))
  for name in ("tree_leaves", "tree_map", "tree_flatten", "tree_map_with_path"):
    monkeypatch.setattr(jax.tree_util, name, counting(getattr(jax.tree_util, name)))
  for _ in range(6):  # Two whole windows, both programs.
    params, state, metrics = step(params, state, batch)
  assert walks == []
  assert int(metrics["update_count"]) == 4
  monkeypatch.undo()
  # A state the step did not return is checked again (here: copied arrays).
  walks.clear()
  monkeypatch.setattr(jax.tree, "leaves", counting(jax.tree.leaves))
  step(params, jax.tree.map(jnp.copy, state), batch)
  assert walks


def test_metrics_stay_readable_after_later_steps():
  """Metrics share the state's counters, which no program donates."""
  step, params, state = _many_leaf_step(3)
  batch = {"x": np.ones(2, np.float32)}
  history = []
  for _ in range(7):
    params, state, metrics = step(params, state, batch)
    history.append(metrics)
  values = [{name: float(value) for name, value in m.items()} for m in history]
  assert [v["updated"] for v in values] == [0, 0, 1, 0, 0, 1, 0]
  assert [v["micro_steps"] for v in values] == [1, 2, 3, 1, 2, 3, 1]
  assert [v["weight"] for v in values] == [2, 4, 6, 2, 4, 6, 2]
  assert all(v["learning_rate"] == pytest.approx(0.1) for v in values)

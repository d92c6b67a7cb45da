"""`make_train_step`: streaming, scan and whole batch agree; params never freeze."""

import functools
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum
from optax_accum import split_micro_batches
from optax_accum._core import _backend

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 4, 20, 1e-3)


def _adamw():
  return optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax_accum.progress_schedule(SCHEDULE), weight_decay=0.1
  )


def _copy(tree):
  """A fresh copy: the step donates (deletes) the buffers it is given."""
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("k", [1, 4])
def test_stream_scan_and_whole_batch_give_the_same_params(k):
  updates = 20
  params0 = toy_lm.init_params(seed=0)
  batches = [toy_lm.make_batch(seed=10 + i) for i in range(updates)]
  whole, whole_losses, whole_norms = toy_lm.whole_batch_run(params0, batches, _adamw())

  results = {}
  for mode in ("stream", "scan"):
    opt = optax_accum.MultiSteps(_adamw(), k)
    step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode=mode)
    params = _copy(params0)
    state = opt.init(params)
    losses, norms = [], []
    for batch in batches:
      params, state, metrics = toy_lm.feed_window(step, params, state, batch, k, mode)
      assert bool(metrics["updated"])
      np.testing.assert_allclose(metrics["weight"], batch["mask"].sum())
      losses.append(float(metrics["loss"]))
      norms.append(float(metrics["grad_norm"]))
    assert int(metrics["update_count"]) == updates
    np.testing.assert_allclose(
      metrics["learning_rate"], SCHEDULE(updates - 1), rtol=1e-6
    )
    results[mode] = params
    # The window loss and gradient norm do not depend on how the batch was split.
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, whole_norms, rtol=1e-5)

  moved = toy_lm.max_rel_diff(params0, whole)
  assert moved > 1e-2, (
    f"params barely moved ({moved:.1e}): the test would prove nothing"
  )
  for mode, params in results.items():
    diff = toy_lm.max_rel_diff(params, whole)
    assert diff <= 1e-5, f"{mode}: max relative params difference {diff:.2e}"


def test_two_function_loop_freezes_params_and_the_step_does_not():
  """F7: one jitted function drops the update, another applies it.

  The loop's own counter calls `apply` when `i % k == 0`, one micro-step after
  each window really ended (inside `accumulate`, which dropped the update): it
  only ever sees zeros. Params never move while the optimizer state counts
  updates.
  """
  k, windows = 4, 5
  params0 = toy_lm.init_params(seed=0)
  stream = [
    mb for i in range(windows) for mb in toy_lm.split(toy_lm.make_batch(seed=i), k)
  ]
  opt = optax.MultiSteps(optax.adamw(1e-2), k)

  @jax.jit
  def accumulate(params, state, batch):  # Runs the real update, throws it away.
    grads, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
    _, state = opt.update(grads, state, params)
    return params, state

  @jax.jit
  def apply(params, state, batch):
    grads, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = params0, opt.init(params0)
  for i, micro_batch in enumerate(stream):
    params, state = (apply if i % k == 0 else accumulate)(params, state, micro_batch)
  assert int(state.gradient_step) == windows  # The state advanced ...
  chex.assert_trees_all_equal(params, params0)  # ... the params never moved.

  ours = optax_accum.MultiSteps(optax.adamw(1e-2), k)
  step = optax_accum.make_train_step(toy_lm.mean_loss, ours)
  params, state = _copy(params0), ours.init(params0)
  for i, micro_batch in enumerate(stream):
    before = _copy(params)
    params, state, metrics = step(params, state, micro_batch)
    ends = i % k == k - 1
    assert bool(metrics["updated"]) == ends
    if ends:
      assert all(
        bool(jnp.any(a != b))
        for a, b in zip(*map(jax.tree.leaves, (params, before)), strict=True)
      )
    else:
      chex.assert_trees_all_equal(params, before)  # Bit-identical inside a window.


def test_streaming_compiles_at_most_two_programs():
  traces = []

  def loss_fn(params, batch):
    traces.append(1)  # Runs once per trace, not per call.
    return toy_lm.mean_loss(params, batch)

  k = 4
  opt = optax_accum.MultiSteps(_adamw(), k)
  step = optax_accum.make_train_step(loss_fn, opt)
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  for i in range(3 * k + 2):
    batch = toy_lm.split(toy_lm.make_batch(seed=i), k)[0]
    # A numpy flag, as a data loader would give it, is read on the host too.
    end = np.bool_(i == 3 * k + 1)
    params, state, metrics = step(params, state, batch, end_window=end)
  assert int(metrics["update_count"]) == 4  # Three full windows, one cut short.
  # Two programs: where a window ends in two (XLA:CPU), the accumulate
  # program adds its last micro-batch and the gradient is traced once.
  two = _backend.for_platform(jax.default_backend()).two_programs
  assert len(traces) == (1 if two else 2)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_each_program_compiles_once_with_committed_arrays(mode, caplog):
  """Params or a batch committed to a device (``jax.device_put(x, device)``)
  commit what the programs return: the first call's uncommitted state (from
  ``step.init``, ``opt.init`` or, in scan mode, the inner optimizer's) is
  committed alike, or every program compiles again on the second call."""
  from benchmarks.accumulation import many_leaves  # 20 small leaves.

  model = many_leaves(20, 8, 2)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  last, first = jax.devices()[-1], jax.devices()[0]
  cases = [("step.init", None, last), ("opt.init", opt.init, first)]
  if mode == "scan":
    cases.append(("inner", opt.inner_opt.init, last))
  for name, init, device in cases:  # Params on the last device, or the batch on 0.

    def loss_fn(params, batch):  # Its own programs, for each init.
      return model["loss_fn"](params, batch)

    step = optax_accum.make_train_step(loss_fn, opt, mode=mode)
    params = jax.tree.map(jnp.copy, model["params"])
    if device is last:
      params = jax.device_put(params, device)
    state = (init or step.init)(params)
    caplog.clear()
    with caplog.at_level("WARNING"), jax.log_compiles(True):
      for _ in range(8 if mode == "stream" else 2):
        rows = model["batch"](model["rows"] * (4 if mode == "scan" else 1))
        batch = split_micro_batches(rows, 4) if mode == "scan" else rows
        if device is first:
          batch = jax.device_put(batch, device)
        params, state, _ = step(params, state, batch)
    compiled = [
      r.getMessage().split("jit(")[1].split(")")[0]
      for r in caplog.records
      if r.getMessage().startswith("Compiling jit(")
    ]
    programs = [p for p in compiled if p in ("accumulate", "ending", "update", "scan")]
    assert programs and len(programs) == len(set(programs)), (name, compiled)
    placed_on = {d for x in jax.tree.leaves((params, state)) for d in x.devices()}
    assert placed_on == {device}


def test_works_traced_inside_the_callers_own_scan():
  k = 4
  params0 = toy_lm.init_params(seed=0)
  micro_batches = [
    mb for i in range(3) for mb in toy_lm.split(toy_lm.make_batch(seed=i), k)
  ]
  opt = optax_accum.MultiSteps(_adamw(), k)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, donate=False)

  params, state = params0, opt.init(params0)
  for micro_batch in micro_batches:
    params, state, _ = step(params, state, micro_batch)

  @jax.jit
  def run(params, state, stacked):
    def body(carry, micro_batch):
      params, state, metrics = step(*carry, micro_batch)
      return (params, state), metrics["updated"]

    return jax.lax.scan(body, (params, state), stacked)

  stacked = jax.tree.map(lambda *x: np.stack(x), *micro_batches)
  (scanned, scanned_state), updated = run(params0, opt.init(params0), stacked)
  assert updated.tolist() == ([False] * (k - 1) + [True]) * 3
  chex.assert_trees_all_close(scanned, params, rtol=1e-6)
  assert int(scanned_state.gradient_step) == 3


@pytest.mark.parametrize("donate", [True, False])
def test_params_and_state_are_donated(donate):
  """The accumulate-only program donates the accumulator and hands params and the
  inner state back untouched; the update program donates all three."""
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, donate=donate)
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  for i in range(2):  # The accumulate program, then the update program.
    batch = toy_lm.split(toy_lm.make_batch(seed=i), 2)[0]
    new_params, new_state, _ = step(params, state, batch)
    read_only = i == 0
    if read_only:
      assert new_params is params
      assert new_state.inner_opt_state is state.inner_opt_state
    donated = [state.acc_grads]
    kept = [params, state.inner_opt_state] if read_only else []
    donated += [] if read_only else [params, state.inner_opt_state]
    # Every params-sized array (XLA may keep a few scalar counters).
    arrays = [x for x in jax.tree.leaves(donated) if x.size > 1]
    assert len(arrays) == (1 if read_only else 4) * len(jax.tree.leaves(params))
    assert [x.is_deleted() for x in arrays] == [donate] * len(arrays)
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    params, state = new_params, new_state


def _dropout_loss(params, batch, key):
  """Token-mean loss with dropout on the embeddings: depends on the key."""
  keep = jax.random.bernoulli(key, 0.7, params["embed"].shape)
  noisy = dict(params, embed=jnp.where(keep, params["embed"] / 0.7, 0.0))
  return toy_lm.mean_loss(noisy, batch)


def test_rng_gives_each_micro_batch_its_own_reproducible_key():
  k = 4
  params0 = toy_lm.init_params(seed=0)
  batches = [toy_lm.make_batch(seed=i) for i in range(3)]

  def run(mode, seed):
    opt = optax_accum.MultiSteps(optax.adam(1e-2), k)
    step = optax_accum.make_train_step(_dropout_loss, opt, mode=mode)
    params, state = _copy(params0), opt.init(params0)
    key = jax.random.key(seed)
    for batch in batches:
      params, state, _ = toy_lm.feed_window(step, params, state, batch, k, mode, key)
    return params

  stream = run("stream", 0)
  chex.assert_trees_all_equal(stream, run("stream", 0))  # Reproducible.
  chex.assert_trees_all_close(run("scan", 0), stream, rtol=1e-5)  # Same keys.
  assert toy_lm.max_rel_diff(run("stream", 1), stream) > 1e-4  # Keys matter.


def _key_loss(params, batch, key):
  """Loss ``sum(params * g) * scale``, weight ``w``; the key's data as aux."""
  loss = jnp.sum(params["w"] * batch["g"]) * batch["scale"]
  return loss, (batch["w"], jax.random.key_data(key))


def test_keys_never_repeat_through_skipped_empty_and_rejected_micro_batches():
  """Issue 16, item 1: with a fixed `rng`, a window skipped as non-finite, an
  all-padding window and a micro-batch rejected by `should_skip_update_fn` move
  no window counter, yet every micro-batch gets a key of its own: the run's
  n-th gets `fold_in(rng, n)`, the same in streaming and scan mode."""
  k = 2
  rows = [  # (scale, weight, rejected): skipped window, empty window, rejection.
    (np.nan, 3.0, False),
    (1.0, 2.0, False),
    (1.0, 0.0, False),
    (1.0, 0.0, False),
    (1.0, 4.0, True),
    (1.0, 1.0, False),
    (1.0, 5.0, False),
  ]
  batches = [
    {
      "g": np.full(3, -1.0 if rejected else i + 1.0, np.float32),
      "scale": np.float32(scale),
      "w": np.float32(weight),
    }
    for i, (scale, weight, rejected) in enumerate(rows)
  ]

  def reject(updates, gradient_step, params):
    del gradient_step, params
    return updates["w"][0] < 0, ()

  rng = jax.random.key(7)
  want = np.stack(
    [jax.random.key_data(jax.random.fold_in(rng, n)) for n in range(len(rows))]
  )
  keys = {}
  for mode, windows in [
    ("stream", [[b] for b in batches]),
    ("scan", [[0, 1], [2, 3], [4, 5, 6]]),
  ]:
    opt = optax_accum.MultiSteps(optax.sgd(0.1), k, should_skip_update_fn=reject)
    step = optax_accum.make_train_step(_key_loss, opt, mode=mode, has_aux=True)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    seen, counters = [], []
    for window in windows:
      if mode == "scan":
        window = [jax.tree.map(lambda *x: np.stack(x), *[batches[i] for i in window])]
      for batch in window:
        params, state, metrics = step(params, state, batch, rng)
        seen.append(np.asarray(metrics["aux"]).reshape(-1, 2))
        counters.append((int(state.gradient_step), int(state.mini_step)))
    keys[mode] = np.concatenate(seen)
    assert int(state.micro_batches_seen) == len(rows)
    assert int(state.skipped_windows) == 1 and int(state.gradient_step) == 1
  np.testing.assert_array_equal(keys["stream"], want)
  np.testing.assert_array_equal(keys["scan"], want)
  assert len({tuple(key) for key in want}) == len(rows)


def test_scan_program_does_not_grow_with_k():
  params = toy_lm.init_params(seed=0)
  sizes, seconds = {}, {}
  for k in (2, 16):
    opt = optax_accum.MultiSteps(optax.adamw(1e-2), k)
    step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode="scan")
    batch = optax_accum.split_micro_batches(toy_lm.make_batch(seed=0, batch=2 * k), k)
    start = time.perf_counter()
    compiled = step.lower(params, opt.init(params), batch).compile()
    seconds[k] = time.perf_counter() - start
    sizes[k] = len(compiled.as_text())
  assert sizes[16] <= 1.05 * sizes[2], (sizes, seconds)


def test_metrics_report_the_window_so_far():
  k = 3
  opt = optax_accum.MultiSteps(_adamw(), k)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt)
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  micro_batches = toy_lm.split(toy_lm.make_batch(seed=0, batch=27), k)
  for i, micro_batch in enumerate(micro_batches):
    so_far = {
      n: np.concatenate([mb[n] for mb in micro_batches[: i + 1]]) for n in micro_batch
    }
    expected_loss, expected_weight = toy_lm.mean_loss(params, so_far)
    params, state, metrics = step(params, state, micro_batch)
    np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
    assert float(metrics["weight"]) == float(expected_weight)
    assert int(metrics["micro_steps"]) == i + 1
    assert bool(metrics["updated"]) == (i == k - 1)
    assert (float(metrics["grad_norm"]) > 0) == (i == k - 1)
  assert set(metrics) == {
    "loss",
    "weight",
    "micro_steps",
    "updated",
    "update_count",
    "grad_norm",
    "skipped_micro_batches",
    "skipped_windows",
    "learning_rate",
  }
  assert int(metrics["skipped_micro_batches"]) == int(metrics["skipped_windows"]) == 0


def test_aux_is_returned_per_micro_batch_and_stacked_in_scan():
  def loss_fn(params, batch):
    loss, weight = toy_lm.mean_loss(params, batch)
    return loss, (weight, {"tokens": weight})

  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  batch = toy_lm.make_batch(seed=0)
  params = toy_lm.init_params(seed=0)
  step = optax_accum.make_train_step(
    loss_fn, opt, mode="scan", has_aux=True, donate=False
  )
  _, _, metrics = step(
    params, opt.init(params), optax_accum.split_micro_batches(batch, 2)
  )
  np.testing.assert_allclose(
    metrics["aux"]["tokens"], [mb["mask"].sum() for mb in toy_lm.split(batch, 2)]
  )


def test_inner_optimizer_gets_the_window_loss_as_value():
  """optax.contrib.reduce_on_plateau needs `value=`: the window's token-mean loss."""
  k = 2
  plateau = optax.contrib.reduce_on_plateau(patience=1, factor=0.5, accumulation_size=1)
  opt = optax_accum.MultiSteps(optax.chain(optax.sgd(0.1), plateau), k)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt)
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  batch = toy_lm.make_batch(seed=0)
  whole_loss, _ = toy_lm.mean_loss(params, batch)
  for micro_batch in toy_lm.split(batch, k):
    params, state, metrics = step(params, state, micro_batch)
  plateau_state = state.inner_opt_state[1]
  np.testing.assert_allclose(plateau_state.best_value, whole_loss, rtol=1e-5)
  assert float(metrics["loss"]) == float(plateau_state.best_value)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_a_plain_optax_optimizer_is_wrapped_for_its_mode(mode):
  """Scan mode needs no k; streaming takes it as `every_k_schedule=`."""
  k = 4
  kwargs = {"every_k_schedule": k} if mode == "stream" else {}
  step = optax_accum.make_train_step(toy_lm.mean_loss, _adamw(), mode=mode, **kwargs)
  ours = optax_accum.make_train_step(
    toy_lm.mean_loss, optax_accum.MultiSteps(_adamw(), k), mode=mode
  )
  batch = toy_lm.make_batch(seed=0)
  windows = (
    [optax_accum.split_micro_batches(batch, k)]
    if mode == "scan"
    else toy_lm.split(batch, k)
  )
  runs = []
  for train_step in (step, ours):
    params = toy_lm.init_params(seed=0)
    state = train_step.init(params)
    for window in windows:
      params, state, metrics = train_step(params, state, window)
    runs.append(params)
  assert bool(metrics["updated"])
  chex.assert_trees_all_equal(*runs)
  if mode == "stream":  # A window spans calls: the state must carry it.
    with pytest.raises(ValueError, match=r"`opt_state` must come from step.init"):
      step(params, _adamw().init(params), windows[0])


def test_the_caller_ends_every_window_without_a_dummy_k():
  """Issue 27, item 4: a dynamic batcher ends each window itself; with
  `every_k_schedule="end_window"` no count ends one, and a schedule in tokens
  gives the whole-batch run's learning rates."""
  schedule = optax_accum.progress_schedule(SCHEDULE, unit="weight", per_update=200)
  adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
  step = optax_accum.make_train_step(
    toy_lm.mean_loss, adamw, every_k_schedule="end_window"
  )
  sizes = [2, 5, 1, 3]  # Micro-batches per window, as the batcher packed them.
  batches = [toy_lm.make_batch(seed=i, batch=4 * k) for i, k in enumerate(sizes)]
  params = toy_lm.init_params(seed=0)
  state = step.init(params)
  for batch, k in zip(batches, sizes, strict=True):
    for i, micro_batch in enumerate(toy_lm.split(batch, k)):
      params, state, metrics = step(params, state, micro_batch, end_window=i == k - 1)
      assert bool(metrics["updated"]) == (i == k - 1)
  assert int(metrics["update_count"]) == len(sizes)

  @jax.jit
  def whole_batch(params, state, batch):
    grads = jax.grad(lambda p: toy_lm.mean_loss(p, batch)[0])(params)
    window_weight = batch["mask"].sum().astype(jnp.float32)
    updates, state = adamw.update(grads, state, params, window_weight=window_weight)
    return optax.apply_updates(params, updates), state

  whole, whole_state = toy_lm.init_params(seed=0), adamw.init(toy_lm.init_params(0))
  for batch in batches:
    whole, whole_state = whole_batch(whole, whole_state, batch)
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5
  assert toy_lm.max_rel_diff(toy_lm.init_params(seed=0), whole) > 1e-3
  np.testing.assert_allclose(
    metrics["learning_rate"], whole_state.hyperparams["learning_rate"], rtol=1e-6
  )
  with pytest.raises(ValueError, match=r"'end_window' \(the caller ends every"):
    optax_accum.MultiSteps(adamw, every_k_schedule="end_windows")


def test_scan_mode_takes_the_optimizers_own_state_and_returns_it():
  """Issue 27: `tx.init(params)`, as every optax user writes it, in scan mode.

  Three AdamW windows of uneven token counts equal the whole batch, and the
  state comes back as the type `tx.init` made."""
  k, batches = 4, [toy_lm.make_batch(seed=i) for i in range(3)]
  tx = toy_lm.adamw_with_schedule(updates=6)
  params0 = toy_lm.init_params(seed=0)
  whole, _, _ = toy_lm.whole_batch_run(params0, batches, tx)
  step = optax_accum.make_train_step(toy_lm.mean_loss, tx, mode="scan")
  params, state = params0, tx.init(params0)
  for batch in batches:
    params, state, metrics = step(params, state, split_micro_batches(batch, k))
    assert type(state) is type(tx.init(params0)) and bool(metrics["updated"])
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5
  lowered = step.lower(params, state, split_micro_batches(batches[0], k))
  assert lowered.compile().memory_analysis() is not None


def test_scan_mode_from_the_optimizers_own_state_counts_what_it_can():
  """Issue 60: from ``tx.init(params)`` every window drew window 0's keys and
  reported update_count 1. Now ``rng=`` is refused there (plain and coupled),
  the count is the inner state's own where it keeps one, and absent where not."""
  params, window = toy_lm.init_params(seed=0), toy_lm.make_batch(seed=0)
  window = split_micro_batches(window, 2)
  counted = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  for tx, counts in ((counted, True), (optax.sgd(0.1), False)):
    step = optax_accum.make_train_step(toy_lm.mean_loss, tx, mode="scan")
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"`rng`.*tx.init\(params\).*step.init"):
      step(params, state, window, jax.random.key(0))
    for update in (1, 2):
      params, state, metrics = step(params, state, window)
      assert (
        int(metrics["update_count"]) == update
        if counts
        else ("update_count" not in metrics)
      )
  from test_coupled import CLIP, _clip_batch, _clip_params

  step = optax_accum.make_train_step(CLIP, optax.sgd(0.1), mode="scan")
  clip = _clip_params(jnp.float32)
  with pytest.raises(ValueError, match=r"`rng`.*step.init"):
    step(
      clip,
      optax.sgd(0.1).init(clip),
      split_micro_batches(_clip_batch(jnp.float32), 2),
      jax.random.key(0),
    )


def test_scan_mode_from_the_optimizers_own_state_runs_in_the_users_jit():
  """The same window in the user's ``jit``, before and after a call outside
  it, as outside: what the step keeps between calls holds no tracer."""
  tx, params = optax.adamw(1e-2), toy_lm.init_params(seed=0)
  step = optax_accum.make_train_step(toy_lm.mean_loss, tx, mode="scan", donate=False)
  window = split_micro_batches(toy_lm.make_batch(seed=0), 4)
  with jax.checking_leaks():  # Raises where a tracer outlives its trace.
    first = jax.jit(step)(params, tx.init(params), window)
    outside = step(params, tx.init(params), window)
    again = jax.jit(step)(params, tx.init(params), window)
  for got in (outside, again):
    assert toy_lm.max_rel_diff(got[0], first[0]) <= 1e-6


def test_scan_mode_arranges_only_a_state_it_did_not_return(monkeypatch):
  """A state the scan step returned last runs as it came back (its layout
  remembered, as when streaming); a copy of it, as from a checkpoint, is
  arranged again, and both windows give the same params."""
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), 4)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode="scan")
  arranged, calls = step._layouts.arranged, []
  monkeypatch.setattr(
    step._layouts, "arranged", lambda *args: calls.append(1) or arranged(*args)
  )
  params, state = toy_lm.init_params(seed=0), opt.init(toy_lm.init_params(seed=0))
  windows = [split_micro_batches(toy_lm.make_batch(seed=i), 4) for i in range(3)]
  for window in windows[:2]:
    params, state, _ = step(params, state, window)
  assert len(calls) == 1
  copied = jax.tree.map(jnp.copy, (params, state))
  returned, _, _ = step(params, state, windows[2])
  restored, _, _ = step(*copied, windows[2])
  assert len(calls) == 2
  assert toy_lm.max_rel_diff(returned, restored) == 0


def test_a_plain_optimizer_that_accumulates_already_is_refused():
  inner = optax.MultiSteps(optax.adam(1e-3), 2).gradient_transformation()
  step = optax_accum.make_train_step(toy_lm.mean_loss, inner, mode="scan")
  params = toy_lm.init_params(seed=0)
  with pytest.raises(ValueError, match=r"already accumulates"):
    step.init(params)
  with pytest.raises(ValueError, match=r"already accumulates"):  # Its own state.
    step(params, inner.init(params), split_micro_batches(toy_lm.make_batch(0), 2))


def test_an_accumulator_inside_multi_steps_is_refused_on_every_path():
  """Issue 26, item 8: `opt.init` (not only `step.init`) refuses it; before,
  the streaming step ran and `update_count` said 3 where the inner
  accumulator had updated every second window."""
  inner = optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()
  opt = optax_accum.MultiSteps(inner, 2)
  optax_accum.make_train_step(toy_lm.mean_loss, opt)  # Building it is fine.
  with pytest.raises(ValueError, match=r"already accumulates"):
    opt.init(toy_lm.init_params(seed=0))
  nested = optax_accum.MultiSteps(optax_accum.MultiSteps(optax.sgd(1.0), 2), 2)
  with pytest.raises(ValueError, match=r"already accumulates"):
    nested.init(toy_lm.init_params(seed=0))


def test_a_batch_array_shared_with_params_is_not_donated_away():
  """The step donates params; a batch leaf that is the same buffer is copied first."""
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)

  def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2), jnp.float32(3)

  step = optax_accum.make_train_step(loss_fn, opt)
  params = {"w": jnp.eye(3)}
  state = opt.init(params)
  batch = {"x": params["w"]}  # The params' own buffer.
  for _ in range(2):
    params, state, metrics = step(params, state, batch)
  assert bool(metrics["updated"]) and not batch["x"].is_deleted()


# --- Errors -----------------------------------------------------------------------


def test_factory_errors():
  with pytest.raises(
    ValueError,
    match=r"`optimizer` must be an optax_accum.MultiSteps in streaming mode unless "
    r"`every_k_schedule=`",
  ):
    optax_accum.make_train_step(toy_lm.mean_loss, optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"no effect in scan mode"):
    optax_accum.make_train_step(
      toy_lm.mean_loss, optax.adam(1e-3), mode="scan", every_k_schedule=2
    )
  with pytest.raises(ValueError, match=r"this optax_accum.MultiSteps has its own"):
    optax_accum.make_train_step(
      toy_lm.mean_loss, optax_accum.MultiSteps(optax.adam(1e-3), 2), every_k_schedule=2
    )
  with pytest.raises(ValueError, match=r"got optax.MultiSteps: wrap your optimizer"):
    optax_accum.make_train_step(toy_lm.mean_loss, optax.MultiSteps(optax.adam(1e-3), 2))
  opt = optax_accum.MultiSteps(optax.adam(1e-3), 2)
  with pytest.raises(
    ValueError, match=r"`mode` must be 'stream' or 'scan', got 'loop'"
  ):
    optax_accum.make_train_step(toy_lm.mean_loss, opt, mode="loop")


def test_loss_fn_contract_is_checked():
  opt = optax_accum.MultiSteps(optax.adam(1e-3), 2)
  params = toy_lm.init_params(seed=0)
  batch = toy_lm.make_batch(seed=0)

  def scalar_loss(params, batch):
    return toy_lm.mean_loss(params, batch)[0]

  step = optax_accum.make_train_step(scalar_loss, opt)
  with pytest.raises(ValueError, match=r"`loss_fn` must return \(loss, weight\)"):
    step(params, opt.init(params), batch)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, has_aux=True)
  with pytest.raises(
    ValueError, match=r"must return \(loss, \(weight, aux\)\) with has_aux=True"
  ):
    step(params, opt.init(params), batch)

  def aux_loss(params, batch):
    loss, weight = toy_lm.mean_loss(params, batch)
    return loss, (weight, {"tokens": weight})

  step = optax_accum.make_train_step(aux_loss, opt)
  with pytest.raises(ValueError, match=r"got \(loss, tuple\): set has_aux=True\?"):
    step(params, opt.init(params), batch)


def test_call_errors():
  opt = optax_accum.MultiSteps(optax.adam(1e-3), 2)
  params = toy_lm.init_params(seed=0)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode="scan")
  with pytest.raises(
    ValueError, match=r"`opt_state` must come from step.init\(params\)"
  ):
    step(params, optax.sgd(1e-3, momentum=0.9).init(params), toy_lm.make_batch(seed=0))
  uneven = {
    "inputs": np.zeros((2, 3, 4), int),
    "targets": np.zeros((3, 3, 4), int),
    "mask": np.ones((2, 3, 4), bool),
  }
  with pytest.raises(ValueError, match=r"the same leading micro-batch axis"):
    step(params, opt.init(params), uneven)
  with pytest.raises(ValueError, match=r"`end_window` is for streaming"):
    step(params, opt.init(params), toy_lm.make_batch(seed=0), end_window=True)


FLAGS = {
  "python": lambda flag: flag,
  "numpy": np.bool_,
  "jnp_bool": jnp.bool_,
  "jax_array": jnp.asarray,
}


@pytest.mark.parametrize("kind", list(FLAGS))
def test_scan_mode_accepts_any_false_end_window(kind):
  """Issue 16, item 5: NumPy and JAX false flags are false too."""
  false = FLAGS[kind](False)
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode="scan")
  params = toy_lm.init_params(seed=0)
  batch = optax_accum.split_micro_batches(toy_lm.make_batch(seed=0), 2)
  _, state, metrics = step(params, opt.init(params), batch, end_window=false)
  assert bool(metrics["updated"]) and int(state.gradient_step) == 1


@pytest.mark.parametrize(
  ("flag", "match"),
  [
    (lambda: np.True_, r"`end_window` is for streaming"),
    (lambda: jnp.asarray(True), r"`end_window` is for streaming"),
    (lambda: 0, r"`end_window` must be a boolean, got dtype int"),
    (lambda: np.zeros(2, bool), r"`end_window` must be a scalar"),
  ],
  ids=["np_true", "jax_true", "int_zero", "array"],
)
def test_scan_mode_rejects_true_or_non_bool_end_window(flag, match):
  """Scan mode ends every window; a non-bool flag is the same error as in
  `MultiSteps.update` (README: `end_window` must be a bool scalar)."""
  flag = flag()
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode="scan")
  params = toy_lm.init_params(seed=0)
  batch = optax_accum.split_micro_batches(toy_lm.make_batch(seed=0), 2)
  with pytest.raises(ValueError, match=match):
    step(params, opt.init(params), batch, end_window=flag)


def test_stream_mode_rejects_a_non_bool_end_window_on_every_micro_step():
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, donate=False)
  params = toy_lm.init_params(seed=0)
  batch = toy_lm.split(toy_lm.make_batch(seed=0), 2)[0]
  with pytest.raises(ValueError, match=r"`end_window` must be a boolean"):
    step(params, opt.init(params), batch, end_window=0)


# --- Batch helpers ----------------------------------------------------------------


class CausalTargetsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True, with_device=True)
  def test_a_sequence_of_n_tokens_has_n_minus_one_targets(self):
    mask = np.arange(8)[None, :] < np.array([[8], [5], [1], [0]])
    targets = self.variant(optax_accum.causal_lm_target_mask)(mask)
    np.testing.assert_array_equal(targets.sum(axis=-1), [7, 4, 0, 0])
    np.testing.assert_array_equal(targets, mask[:, 1:])  # Left-aligned padding.


def test_causal_targets_errors():
  with pytest.raises(ValueError, match="must be boolean"):
    optax_accum.causal_lm_target_mask(np.ones((2, 4)))
  with pytest.raises(ValueError, match="time axis of length >= 2"):
    optax_accum.causal_lm_target_mask(np.ones((2, 1), bool))


def test_split_micro_batches():
  batch = toy_lm.make_batch(seed=0, batch=12)
  split = optax_accum.split_micro_batches(batch, 3)
  assert split["inputs"].shape == (3, 4, 16)
  for i, micro_batch in enumerate(toy_lm.split(batch, 3)):
    chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i: x[i], split), micro_batch)
  with pytest.raises(
    ValueError,
    match=r"leaf \['inputs'\] has shape \(12, 16\): "
    r"its leading axis must be divisible by k=5",
  ):
    optax_accum.split_micro_batches(batch, 5)
  with pytest.raises(ValueError, match=r"`k` must be an int >= 1, got 0"):
    optax_accum.split_micro_batches(batch, 0)


def test_jit_helper_split_is_traceable():
  split = jax.jit(functools.partial(optax_accum.split_micro_batches, k=2))(
    {"x": jnp.arange(4)}
  )
  np.testing.assert_array_equal(split["x"], [[0, 2], [1, 3]])


@pytest.mark.parametrize("committed", [False, True])
def test_step_init_on_one_device_is_opt_init(committed):
  """On one device ``step.init(params)`` gives ``opt.init(params)``'s state:
  one sum, the same structure, bit for bit and placed alike (committed to
  the params' device or not), on 20 small leaves (which it once packed),
  and without compiling a program of its own."""
  from benchmarks.accumulation import many_leaves

  model = many_leaves(20, 8, 2)
  device = jax.devices()[-1]
  params = jax.device_put(model["params"], device if committed else None)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  want = opt.init(params)  # Whatever opt.init compiles, it compiles here.
  compiled = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    state = step.init(params)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiled == []
  assert jax.tree.structure(state) == jax.tree.structure(want)
  chex.assert_trees_all_equal(state, want)
  placed = {(x.committed, *x.devices()) for x in jax.tree.leaves(state.acc_grads)}
  assert placed == {(committed, device if committed else jax.devices()[0])}


def test_scan_from_the_inner_state_passes_no_sums():
  """From ``tx.init(params)`` the scan program neither takes nor returns the
  window's sums (a buffer a leaf): the host passes params, inner state,
  counters and batch, and gets back params, inner state, counters, metrics."""
  from benchmarks import accumulation
  from optax_accum._step._programs import counters as _counters

  model = accumulation.MODELS["lm-1x8-b2"]()
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  step = optax_accum.make_train_step(model["loss_fn"], opt, mode="scan")
  params, inner = model["params"], opt.inner_opt.init(model["params"])
  window = optax_accum.split_micro_batches(model["batch"](4 * model["rows"]), 4)
  lowered = step.lower(params, inner, window)
  compiled = lowered.compile()
  counters = _counters(opt.init(params))
  expected_in = [params, inner, counters, window]
  assert len(jax.tree.leaves(lowered.args_info)) == len(jax.tree.leaves(expected_in))
  expected_out = [params, inner, counters]
  metrics = len(jax.tree.leaves(jax.eval_shape(step, params, inner, window)[2]))
  outputs = len(jax.tree.leaves(compiled.output_shardings))
  assert outputs == len(jax.tree.leaves(expected_out)) + metrics


def test_scan_from_the_inner_state_lowers_from_shapes_alone():
  """``lower`` takes shapes for every argument, the inner state's included
  (its update count has no value yet), and gives the program a call runs."""
  tx = optax.adamw(1e-2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, tx, mode="scan")
  params = toy_lm.init_params(seed=0)
  window = split_micro_batches(toy_lm.make_batch(seed=0), 4)
  shapes = jax.eval_shape(lambda: (params, tx.init(params), window))
  from_shapes = step.lower(*shapes).as_text()
  assert from_shapes == step.lower(params, tx.init(params), window).as_text()


def test_a_call_traced_only_through_params_keeps_no_tracer_on_the_host():
  """The state the step returned last, closed over by the user's jit while the
  params are traced: the call is traced (its outputs are), so the host keeps
  knowing the state it returned, not the trace's values."""

  def loss_fn(params, batch):
    return ((batch["x"] @ params) ** 2).mean(), jnp.float32(batch["x"].shape[0])

  opt = optax_accum.MultiSteps(optax.sgd(0.1), 3)
  step = optax_accum.make_train_step(loss_fn, opt, donate=False)
  params, batch = jnp.ones((2,)), {"x": jnp.ones((4, 2))}
  params, state, _ = step(params, opt.init(params), batch)
  known = step._known
  jax.jit(lambda p: step(p, state, batch)[0])(params)
  assert step._known is known
  after = step(params, state, batch)  # The fast path, as before the trace.
  assert int(after[1].mini_step) == 2

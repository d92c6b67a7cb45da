"""Deterministic cost targets: XLA's memory analysis, and one optimizer run per window.

Wall-time targets live in `benchmarks/accumulation.py`; these cannot drift with
machine noise.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from benchmarks.hlo import ops

WIDTH, DEPTH, ROWS = 64, 3, 4


def _params():
  keys = jax.random.split(jax.random.key(0), DEPTH)
  return {f"w{i}": jax.random.normal(key, (WIDTH, WIDTH)) for i, key in enumerate(keys)}


def _loss(params, batch):
  h = batch["x"]
  for i in range(DEPTH):
    h = jnp.tanh(h @ params[f"w{i}"])
  return jnp.mean((h - batch["y"]) ** 2), jnp.float32(batch["x"].shape[0])


def _batch(rows):
  rng = np.random.default_rng(0)
  return {
    "x": rng.normal(size=(rows, WIDTH)).astype(np.float32),
    "y": rng.normal(size=(rows, WIDTH)).astype(np.float32),
  }


def _temp_bytes(lowered):
  return lowered.compile().memory_analysis().temp_size_in_bytes


def _whole_step(params, state, batch):
  grads, _ = jax.grad(_loss, has_aux=True)(params, batch)
  updates, state = optax.adamw(1e-3).update(grads, state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="XLA:CPU's figures and programs"
)
def test_scan_temp_bytes_do_not_grow_with_k_but_the_whole_batch_does():
  params = _params()
  scan_temp, whole_temp = {}, {}
  for k in (4, 16):
    opt = optax_accum.MultiSteps(optax.adamw(1e-3), k)
    step = optax_accum.make_train_step(_loss, opt, mode="scan")
    stacked = optax_accum.split_micro_batches(_batch(ROWS * k), k)
    scan_temp[k] = _temp_bytes(step.lower(params, opt.init(params), stacked))
    whole = jax.jit(_whole_step, donate_argnums=(0, 1))
    whole_temp[k] = _temp_bytes(
      whole.lower(params, optax.adamw(1e-3).init(params), _batch(ROWS * k))
    )
  assert scan_temp[16] <= 1.05 * scan_temp[4], scan_temp
  assert whole_temp[16] > 1.5 * whole_temp[4], whole_temp


@pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="XLA:CPU's figures and programs"
)
def test_streaming_temp_bytes_no_larger_than_optax_multisteps():
  """Both streaming programs need no more scratch memory than optax.MultiSteps;
  the accumulate-only one (k - 1 of every k calls) far less."""
  params, micro = _params(), _batch(ROWS)
  ours = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  step = optax_accum.make_train_step(_loss, ours)
  state = ours.init(params)
  accumulate_temp = _temp_bytes(step.lower(params, state, micro, program="accumulate"))
  update_temp = _temp_bytes(step.lower(params, state, micro))
  theirs = optax.MultiSteps(optax.adamw(1e-3), 4)

  def optax_step(params, state, batch):
    grads, _ = jax.grad(_loss, has_aux=True)(params, batch)
    updates, state = theirs.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  theirs_temp = _temp_bytes(
    jax.jit(optax_step, donate_argnums=(0, 1)).lower(params, theirs.init(params), micro)
  )
  assert accumulate_temp <= 0.5 * theirs_temp, (accumulate_temp, theirs_temp)
  assert update_temp <= theirs_temp, (update_temp, theirs_temp)


def test_state_holds_params_sized_buffers_only_for_accumulator_and_inner():
  params = _params()
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  state = optax_accum.MultiSteps(optax.adamw(1e-3), 4).init(params)
  inner_bytes = sum(x.nbytes for x in jax.tree.leaves(state.inner_opt_state))
  acc_bytes = sum(x.nbytes for x in jax.tree.leaves(state.acc_grads))
  total = sum(x.nbytes for x in jax.tree.leaves(state))
  assert acc_bytes == param_bytes  # float32 params: one float32 accumulator.
  assert inner_bytes < 2 * param_bytes + 64  # AdamW: mu and nu, and a count.
  assert total - inner_bytes - acc_bytes <= 64  # The rest is a few scalars.


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_inner_optimizer_runs_once_per_window_in_the_train_step(mode):
  calls = []

  def update(updates, state, params=None):
    del params
    jax.debug.callback(lambda _: calls.append(1), jax.tree.leaves(updates)[0])
    return updates, state

  counting = optax.chain(
    optax.GradientTransformation(lambda p: optax.EmptyState(), update), optax.sgd(1e-3)
  )
  k, windows = 4, 3
  opt = optax_accum.MultiSteps(counting, k)
  step = optax_accum.make_train_step(_loss, opt, mode=mode)
  params, state = _params(), opt.init(_params())
  for _ in range(windows):
    if mode == "scan":
      params, state, _ = step(
        params, state, optax_accum.split_micro_batches(_batch(ROWS * k), k)
      )
    else:
      for _ in range(k):
        params, state, _ = step(params, state, _batch(ROWS))
  jax.effects_barrier()
  assert len(calls) == windows
  assert int(state.gradient_step) == windows


@pytest.mark.parametrize("program", ["stream", "scan"])
def test_update_programs_copy_no_params_sized_buffer(program):
  """Params, optimizer state and accumulator are updated in place: no `copy`."""
  params = _params()
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  step = optax_accum.make_train_step(
    _loss, opt, mode="scan" if program == "scan" else "stream"
  )
  state = opt.init(params)
  if program == "scan":
    stacked = optax_accum.split_micro_batches(_batch(ROWS * 4), 4)
    hlo = step.lower(params, state, stacked)
  else:
    hlo = step.lower(params, state, _batch(ROWS))
  hlo = hlo.compile().as_text()
  copies = re.findall(rf"= f32\[{WIDTH},{WIDTH}\]\S* copy\(", hlo)
  assert not copies, f"{len(copies)} params-sized copies"
  assert "input_output_alias" in hlo  # The donated buffers are reused.


def test_update_program_writes_no_params_sized_constant():
  """The window's norm and finite check add no array of constants to read.

  On XLA:CPU a reduction fused with a scalar operand materialises that scalar
  as a leaf-shaped array, which every leaf's reduction reads. The window's
  ``1 / weight`` costs one such array; the finite check used to add a second,
  of zeros (``g * 0``), where ``g - g`` needs none.
  """
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's reduction fusions")
  params = _params()
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  step = optax_accum.make_train_step(_loss, opt)
  hlo = step.lower(params, opt.init(params), _batch(ROWS)).compile().as_text()
  computations = re.split(r"\n(?=\S)", hlo)
  broadcasts = {
    text.split()[0].lstrip("%")
    for text in computations
    if re.search(rf"ROOT \S+ = f32\[{WIDTH},{WIDTH}\]\S* broadcast\(", text)
  }
  entry = next(text for text in computations if text.startswith("ENTRY"))
  called = [re.search(r"calls=%([\w.]+)", line) for line in entry.splitlines()]
  assert any(called), "no fusion calls parsed: has the HLO text format changed?"
  materialised = [m.group(0) for m in called if m and m.group(1) in broadcasts]
  assert len(materialised) <= 1, materialised


@pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="XLA:CPU's figures and programs"
)
def test_step_in_your_jit_reads_the_sums_only_where_a_window_ends():
  """Traced in the caller's ``jit`` the step runs its update program on every
  micro-step. The window's norm and finite check (a reduction a leaf) run
  in a ``cond`` branch taken only where a window ends, as the optimizer's
  is: outside its branches the program reduces no more than the bare
  accumulate call.

  Computed before that branch they read every sum on every micro-step: the
  8M-param MLP took 1.34x its floor a micro-step, and 0.99x once they were
  moved in (issue 29).
  """
  params, batch = _params(), _batch(ROWS)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  step = optax_accum.make_train_step(_loss, opt)

  def accumulate(sums, params, batch):
    (loss, weight), grads = jax.value_and_grad(_loss, has_aux=True)(params, batch)
    return jax.tree.map(lambda s, g: s + weight * g, sums, grads), loss

  def reductions(lowered):
    return ops(lowered.compile().as_text(), ("reduce", "reduce-window"))

  zeros = jax.tree.map(jnp.zeros_like, params)
  hand = reductions(jax.jit(accumulate).lower(zeros, params, batch))
  ours = reductions(jax.jit(step).lower(params, opt.init(params), batch))
  assert any(op.in_branch for op in ours)  # The window's end: norm, finite check.
  outside = [sum(not op.in_branch for op in found) for found in (ours, hand)]
  assert outside[0] <= outside[1], outside


def _peak(lowered) -> int:
  m = lowered.compile().memory_analysis()
  return (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
  )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's two programs")
def test_a_window_ends_in_two_programs_within_the_merged_ones_memory():
  """The window's last call runs the accumulate program, then the ending;
  ``lower`` gives the two as one program, whose peak bounds each's (the
  inner state resident while the accumulate program runs)."""
  from benchmarks import accumulation
  from optax_accum._step._programs import Inputs, TwoPrograms, counters

  model = accumulation.many_leaves(64, 32, 4)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), 4)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  params, batch = model["params"], model["batch"](2)
  params, state, layout = step._layouts.arranged(params, step.init(params), batch)
  accumulate, update = step._layouts.programs(layout)
  assert isinstance(update, TwoPrograms)
  assert update.accumulate is accumulate
  inner, acc = state.inner_opt_state, state.acc_grads
  inputs = Inputs(params, inner, acc, counters(state), batch, None, False)
  merged = _peak(update.lower(inputs))
  resident = sum(x.nbytes for x in jax.tree.leaves(inner))
  accumulating = _peak(accumulate.lower(inputs._replace(inner=None, end_window=None)))
  assert accumulating + resident <= merged
  assert _peak(update.ending.lower(inputs._replace(batch=None))) <= merged

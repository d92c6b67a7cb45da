"""plan_micro_batches: predictions from XLA, checked against the programs that run.

Every plan here compiles a handful of tiny programs (a 2.6k-parameter MLP); the
budgets are stated in bytes, and what is checked is computed from XLA's own
memory analyses, never written down.
"""

import logging
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum._planning import _plan as _planning

#: Tests whose budgets are set from XLA:CPU's memory figures.
CPU_BUDGETS = pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="budgets set from XLA:CPU's memory figures"
)

IN, HIDDEN, OUT = 16, 128, 4
AUTO = jax.sharding.AxisType.Auto


def _loss(params, batch):
  """Token-mean squared error; an all-zero (padding) row has mask 0, weight 0."""
  h = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
  mask = batch["mask"]
  return ((h - batch["y"]) ** 2 * mask[:, None]).sum() / mask.sum(), mask.sum()


def _params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
    "w1": jax.random.normal(k1, (IN, HIDDEN)) / 4,
    "w2": jax.random.normal(k2, (HIDDEN, OUT)) / 8,
  }


def _batch(rows, seed=1):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(rows, IN)).astype(np.float32),
    "y": rng.normal(size=(rows, OUT)).astype(np.float32),
    "mask": (rng.random(rows) < 0.8).astype(np.float32),
  }


def _structs(tree, sharding=None):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
  )


def _program(candidate, name):
  (program,) = [p for p in candidate.programs if p.program == name]
  return program


def _assert_matches_the_run(planned, compiled):
  """The plan's numbers for one program are XLA's for the program that runs."""
  stats = compiled.memory_analysis()
  assert planned.argument_bytes == stats.argument_size_in_bytes
  assert planned.output_bytes == stats.output_size_in_bytes
  assert planned.alias_bytes == stats.alias_size_in_bytes
  assert planned.temp_bytes == stats.temp_size_in_bytes
  assert planned.alias_bytes > 0  # Donation is in the program that runs.
  # The stated formula bounds XLA's own live-range peak from above.
  assert planned.peak_bytes >= stats.peak_memory_in_bytes


def _sorted_sizes(plan, pad=False):
  units = plan.global_batch
  if plan.mode == "scan" and not pad:
    return [d for d in range(1, units + 1) if units % d == 0]
  return sorted({-(-units // k) for k in range(1, units + 1)})


def _assert_binary_search_result(plan, sizes):
  """Chosen fits, the next size up was compiled and does not, k covers the batch."""
  by_size = {c.micro_batch: c for c in plan.candidates}
  assert plan.peak_bytes == by_size[plan.micro_batch].peak_bytes <= plan.budget_bytes
  index = sizes.index(plan.micro_batch)
  if index + 1 < len(sizes):
    assert by_size[sizes[index + 1]].peak_bytes > plan.budget_bytes
  for c in plan.candidates:  # Monotone: smaller sizes fit, larger do not.
    assert c.fits == (c.micro_batch <= plan.micro_batch), c
  assert plan.k == math.ceil(plan.global_batch / plan.micro_batch)
  assert (plan.k - 1) * plan.micro_batch < plan.global_batch
  assert plan.k * plan.micro_batch >= plan.global_batch
  # The whole batch, then a binary search over the sizes below it.
  assert plan.candidates[0].micro_batch == plan.global_batch
  assert len(plan.candidates) <= 1 + math.ceil(math.log2(len(sizes)))


@CPU_BUDGETS
def test_stream_plan_fits_the_budget_and_matches_the_run(monkeypatch, capsys):
  """37 rows (prime): any size leaves a shorter last micro-batch, which the plan
  compiles too. Each program that then runs has exactly the planned analysis,
  and the window equals the whole-batch update."""
  monkeypatch.setattr(_planning, "_PROGRESS_DELAY_S", 0.0)
  rows, budget = 37, 50_000
  params, inner = _params(), optax.sgd(0.1, momentum=0.9)
  plan = optax_accum.plan_micro_batches(
    _loss,
    inner,
    _structs(params),
    _structs(_batch(rows)),
    memory_budget=budget,
    compare_modes=False,
  )
  assert "planning micro-batches" in capsys.readouterr().err  # The bar showed.
  assert plan.mode == "stream" and plan.budget_bytes == budget
  assert 1 < plan.k < rows, "the budget should force accumulation"
  _assert_binary_search_result(plan, _sorted_sizes(plan))
  assert plan.last_micro_batch == rows - (plan.k - 1) * plan.micro_batch
  assert plan.last_micro_batch < plan.micro_batch  # 37 is prime.
  chosen = plan.chosen
  accumulate, update = _program(chosen, "accumulate"), _program(chosen, "update")
  assert (accumulate.rows, update.rows) == (plan.micro_batch, plan.last_micro_batch)
  assert accumulate.resident_bytes == plan.opt_state_bytes > 0
  assert plan.peak_bytes == max(accumulate.peak_bytes, update.peak_bytes)

  # The run: the same programs, from real arrays.
  opt = optax_accum.MultiSteps(inner, every_k_schedule=plan.k)
  step = optax_accum.make_train_step(_loss, opt)
  state, run_params = opt.init(params), jax.tree.map(jnp.copy, params)
  micro_batches = plan.split(_batch(rows))
  assert [len(mb["x"]) for mb in micro_batches] == [plan.micro_batch] * (plan.k - 1) + [
    plan.last_micro_batch
  ]
  for i, micro_batch in enumerate(micro_batches):
    name = "update" if i == plan.k - 1 else "accumulate"
    compiled = step.lower(run_params, state, micro_batch, program=name).compile()
    _assert_matches_the_run(_program(chosen, name), compiled)
    run_params, state, metrics = step(run_params, state, micro_batch)
    assert bool(metrics["updated"]) == (i == plan.k - 1)

  grads, _ = jax.grad(_loss, has_aux=True)(params, _batch(rows))
  for name in params:  # First momentum-SGD update: -0.1 * whole-batch gradient.
    np.testing.assert_allclose(
      run_params[name], params[name] - 0.1 * grads[name], rtol=1e-5, atol=1e-7
    )

  text = str(plan)
  assert f"{plan.micro_batch} rows x k={plan.k}" in text
  (chosen_line,) = [line for line in text.splitlines() if "<- chosen" in line]
  assert chosen_line.split()[:3] == [
    str(plan.micro_batch),
    str(plan.k),
    str(plan.last_micro_batch),
  ]
  table = [
    line for line in text.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s", line)
  ]
  assert len(table) == len(plan.candidates)


def _compiled_during(caplog, run):
  """What ``run()`` returns, and the programs XLA compiled while it ran."""
  caplog.clear()
  with caplog.at_level(logging.WARNING), jax.log_compiles(True):
    out = run()
  return out, [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]


@CPU_BUDGETS
@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_the_plans_step_runs_its_windows_without_compiling_again(mode, caplog):
  """Issue 27, item 3: the plan hands back the step it compiled and measured;
  two windows run on it compile nothing, and equal the whole-batch updates."""
  rows, inner = 37, optax.sgd(0.1, momentum=0.9)
  params = _params()
  plan = optax_accum.plan_micro_batches(
    _loss,
    inner,
    params,
    _batch(rows),
    memory_budget=50_000 if mode == "stream" else 48_000,
    mode=mode,
    pad=mode == "scan",
    compare_modes=False,
    progress=False,
  )
  assert 1 < plan.k < rows and plan.step.mode == mode
  assert plan.step.optimizer.config.constant_k == plan.k
  batches = [_batch(rows, seed=s) for s in (1, 2)]

  def two_windows(step_params, opt_state):
    for batch in batches:
      step_params, opt_state, metrics = plan.window(step_params, opt_state, batch)
    return step_params, metrics

  start = (jax.tree.map(jnp.copy, params), plan.step.init(params))
  (got, metrics), compiled = _compiled_during(caplog, lambda: two_windows(*start))
  assert compiled == [] and int(metrics["update_count"]) == 2
  # The check can fail: a step built anew compiles its programs.
  fresh = optax_accum.make_train_step(_loss, plan.step.optimizer, mode=mode)
  calls = plan.split(batches[0])
  first = calls if mode == "scan" else calls[0]
  copy = jax.tree.map(jnp.copy, params)
  _, compiled = _compiled_during(caplog, lambda: fresh(copy, fresh.init(copy), first))
  assert compiled

  whole, state = params, inner.init(params)
  for batch in batches:
    grads, _ = jax.grad(_loss, has_aux=True)(whole, batch)
    updates, state = inner.update(grads, state, whole)
    whole = optax.apply_updates(whole, updates)
  for name in params:
    np.testing.assert_allclose(got[name], whole[name], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharded_params_and_batch_give_per_device_figures_of_the_run():
  """Model-sharded params and a data-sharded batch on 8 devices: the plan's
  per-device numbers (its opt_state shardings derived from the params') are
  the run's, with the state from an eager init."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  param_shardings = {
    "w1": NamedSharding(mesh, P(None, "data")),
    "w2": NamedSharding(mesh, P("data", None)),
  }
  rows_sharding = NamedSharding(mesh, P("data"))
  params = jax.device_put(_params(), param_shardings)
  batch = jax.device_put(_batch(32), rows_sharding)
  inner = optax.adamw(1e-2)
  budget = 10_240
  plan = optax_accum.plan_micro_batches(
    _loss, inner, params, _structs(_batch(32), rows_sharding), memory_budget=budget
  )
  # Sizes are multiples of the 8 row shards: 8, 16, 32.
  assert {c.micro_batch % 8 for c in plan.candidates} == {0}
  assert plan.k == 2, "the budget should force accumulation"
  _assert_binary_search_result(plan, [8, 16, 32])
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  assert plan.params_bytes == param_bytes // 8  # Per device.
  # Adam's moments are sharded like the params: two params' worth plus counts.
  assert 2 * param_bytes // 8 <= plan.opt_state_bytes < 2 * param_bytes // 8 + 64
  scan = plan.other_mode
  assert scan is not None and scan.mode == "scan" and scan.micro_batch == 16

  opt = optax_accum.MultiSteps(inner, every_k_schedule=plan.k)
  step = optax_accum.make_train_step(_loss, opt)
  state = opt.init(params)
  for i, micro_batch in enumerate(plan.split(batch)):
    assert micro_batch["x"].sharding == rows_sharding
    name = "update" if i == plan.k - 1 else "accumulate"
    compiled = step.lower(params, state, micro_batch, program=name).compile()
    _assert_matches_the_run(_program(plan.chosen, name), compiled)
    params, state, _ = step(params, state, micro_batch)
  assert int(state.gradient_step) == 1
  assert params["w1"].sharding == param_shardings["w1"]

  # Scan at the same size: its stacked batch, sharded along rows, as planned.
  scan_step = optax_accum.make_train_step(_loss, opt, mode="scan")
  stacked = optax_accum.split_micro_batches(batch, plan.k)
  compiled = scan_step.lower(params, state, stacked).compile()
  _assert_matches_the_run(_program(scan, "scan"), compiled)


@CPU_BUDGETS
def test_scan_with_padding_runs_exactly_the_planned_program():
  """Scan, 37 rows, pad=True: the window is padded with zero rows (weight 0)
  to k equal micro-batches; one program, analysed as planned; exact."""
  rows, budget = 37, 48_000
  params, inner = _params(), optax.sgd(0.1)
  plan = optax_accum.plan_micro_batches(
    _loss,
    inner,
    params,
    _batch(rows),
    memory_budget=budget,
    mode="scan",
    pad=True,
    compare_modes=False,
    progress=False,
  )
  assert 1 < plan.k < rows, "the budget should force accumulation"
  _assert_binary_search_result(plan, _sorted_sizes(plan, pad=True))
  assert plan.pad_rows == plan.k * plan.micro_batch - rows > 0
  (program,) = plan.chosen.programs
  assert program.program == "scan" and program.resident_bytes == 0

  opt = optax_accum.MultiSteps(inner, every_k_schedule=plan.k)
  step = optax_accum.make_train_step(_loss, opt, mode="scan")
  stacked = plan.split(_batch(rows))
  assert stacked["x"].shape == (plan.k, plan.micro_batch, IN)
  state = opt.init(params)
  _assert_matches_the_run(program, step.lower(params, state, stacked).compile())
  new_params, _, metrics = step(jax.tree.map(jnp.copy, params), state, stacked)
  assert float(metrics["weight"]) == _batch(rows)["mask"].sum()
  grads, _ = jax.grad(_loss, has_aux=True)(params, _batch(rows))
  for name in params:
    np.testing.assert_allclose(
      new_params[name], params[name] - 0.1 * grads[name], rtol=1e-5, atol=1e-7
    )


@CPU_BUDGETS
def test_scan_without_padding_searches_divisors_and_compares_stream():
  plan = optax_accum.plan_micro_batches(
    _loss,
    optax.sgd(0.1),
    _params(),
    _structs(_batch(12)),
    memory_budget=35_000,
    mode="scan",
    progress=False,
  )
  assert 1 < plan.k < 12, "the budget should force accumulation"
  assert all(12 % c.micro_batch == 0 for c in plan.candidates)
  _assert_binary_search_result(plan, [1, 2, 3, 4, 6, 12])
  assert plan.pad_rows == 0 and plan.last_micro_batch == plan.micro_batch
  stream = plan.other_mode
  assert stream is not None and stream.mode == "stream"
  assert [p.program for p in stream.programs] == ["accumulate", "update"]
  smaller = "scan" if plan.peak_bytes <= stream.peak_bytes else "stream"
  assert f"{smaller} needs less" in str(plan)


def test_an_optimizer_factory_sets_the_multisteps_options():
  """bfloat16 accumulator: half the float32 one, as XLA counts it."""
  params, batch = _structs(_params()), _structs(_batch(1))  # One compile each.
  plans = [
    optax_accum.plan_micro_batches(
      _loss,
      lambda k, dtype=dtype: optax_accum.MultiSteps(
        optax.sgd(0.1), k, accumulator_dtype=dtype
      ),
      params,
      batch,
      memory_budget=10**8,
      compare_modes=False,
      progress=False,
    )
    for dtype in (jnp.float32, jnp.bfloat16)
  ]
  param_bytes = (IN * HIDDEN + HIDDEN * OUT) * 4
  counters = plans[0].accumulator_bytes - param_bytes
  assert 0 < counters < 64
  assert plans[1].accumulator_bytes == param_bytes // 2 + counters


# --- the budget ---------------------------------------------------------------


class _FakeDevice:
  def __init__(self, stats):
    self._stats = stats

  def memory_stats(self):
    return self._stats


def test_default_budget_is_the_smallest_device_limit_less_headroom():
  devices = [
    _FakeDevice({"bytes_limit": 16 * 2**30, "bytes_in_use": 5}),
    _FakeDevice({"bytes_limit": 8 * 2**30}),
  ]
  assert _planning._default_budget(devices, 0.1) == int(8 * 2**30 * 0.9)
  assert _planning._default_budget(devices, 0.0) == 8 * 2**30
  with pytest.raises(ValueError, match="Pass `memory_budget`"):
    _planning._default_budget([*devices, _FakeDevice(None)], 0.1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU's budget")
def test_cpu_needs_a_stated_budget():
  assert jax.devices()[0].memory_stats() is None  # What CPUs report.
  with pytest.raises(ValueError, match=r"Pass `memory_budget` \(bytes per device\)"):
    optax_accum.plan_micro_batches(_loss, optax.sgd(0.1), _params(), _batch(4))


# --- bad inputs -----------------------------------------------------------------


def test_budget_smaller_than_params_and_state_alone():
  params = _params()
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  # Adam: params, two moments, a float32 accumulator: over 4x the params.
  with pytest.raises(ValueError, match="smaller than params and optimizer state"):
    optax_accum.plan_micro_batches(
      _loss, optax.adam(1e-3), params, _batch(8), memory_budget=3 * param_bytes
    )


def test_budget_that_fits_the_state_but_no_micro_batch():
  params = _params()
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  with pytest.raises(ValueError, match="No micro-batch fits") as error:
    optax_accum.plan_micro_batches(
      _loss,
      optax.sgd(0.1),
      params,
      _batch(2),
      memory_budget=2 * param_bytes + 1024,  # Params and accumulator fit.
      progress=False,
    )
  assert "update at 1 rows" in str(error.value)


@pytest.mark.parametrize(
  ("batch", "global_batch", "match"),
  [
    (_batch(0), None, "`global_batch` must be >= 1 row, got 0"),
    (_batch(8), 0, "`global_batch` must be >= 1 row, got 0"),
    (_batch(8), 2.5, "`global_batch` must be an int"),
    ({"x": np.zeros((8, 3)), "n": np.float32(8)}, None, r"leaf \['n'\] has shape \(\)"),
    (
      {"x": np.zeros((8, 3)), "y": np.zeros((6,))},
      None,
      r"\['x'\] has 8 rows, \['y'\] has 6",
    ),
    ({}, None, "`batch` has no arrays"),
  ],
)
def test_bad_batches(batch, global_batch, match):
  with pytest.raises(ValueError, match=match):
    optax_accum.plan_micro_batches(
      _loss,
      optax.sgd(0.1),
      _params(),
      batch,
      global_batch=global_batch,
      memory_budget=10**8,
    )


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"optimizer": optax_accum.MultiSteps(optax.sgd(0.1), 2)}, "inner optax"),
    ({"optimizer": 3}, "GradientTransformation"),
    ({"optimizer": lambda k: optax.sgd(0.1)}, r"`optimizer\(1\)` must return"),
    ({"mode": "loop"}, "`mode` must be"),
    ({"memory_budget": 1.5e9}, "`memory_budget` must be an int"),
    ({"headroom": 1.0}, "`headroom` must be in"),
  ],
)
def test_bad_arguments(kwargs, match):
  args = {"optimizer": optax.sgd(0.1), "memory_budget": 10**8, **kwargs}
  optimizer = args.pop("optimizer")
  with pytest.raises(ValueError, match=match):
    optax_accum.plan_micro_batches(_loss, optimizer, _params(), _batch(4), **args)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_global_batch_must_split_over_the_row_shards():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  batch = _structs(_batch(12), NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match="multiple of the 8 data-parallel shards"):
    optax_accum.plan_micro_batches(
      _loss, optax.sgd(0.1), _params(), batch, memory_budget=10**8
    )


# --- the search -----------------------------------------------------------------


def test_candidate_sizes():
  for units in range(1, 300):
    brute = sorted({-(-units // k) for k in range(1, units + 1)})
    assert _planning._covering_sizes(units) == brute
    assert _planning._divisors(units) == [
      d for d in range(1, units + 1) if units % d == 0
    ]


def test_whole_batch_that_fits_is_one_compile_and_no_tqdm_is_silent(
  monkeypatch, capsys
):
  monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` fails.
  monkeypatch.setattr(_planning, "_PROGRESS_DELAY_S", 0.0)
  plan = optax_accum.plan_micro_batches(
    _loss,
    optax.sgd(0.1),
    _params(),
    _batch(4),
    memory_budget=10**8,
    compare_modes=False,
  )
  assert capsys.readouterr().err == ""
  # The whole batch fits: one compile, of the update program only (k = 1).
  assert [c.micro_batch for c in plan.candidates] == [4] and plan.k == 1
  assert [p.program for p in plan.chosen.programs] == ["update"]
  with pytest.raises(ValueError, match="must have the plan's 4 rows"):
    plan.split(_batch(3))


def test_abstract_params_of_many_small_leaves_plan_the_programs_that_run():
  """Issue 43 item 3: on 20 small leaves given as ``jax.ShapeDtypeStruct``,
  ``step.lower`` and ``plan_micro_batches`` lower the programs that will run
  (``step.init`` on shapes gives the one sum it gives on arrays)."""
  params = {f"b{i:02d}": jax.ShapeDtypeStruct((8,), jnp.float32) for i in range(20)}

  def loss_fn(p, batch):
    return sum(v.sum() for v in p.values()) ** 2 * batch["x"].mean(), 1.0

  opt = optax_accum.MultiSteps(optax.sgd(0.1), 4)
  step = optax_accum.make_train_step(loss_fn, opt)
  state = jax.eval_shape(step.init, params)
  assert jax.tree.structure(state.acc_grads) == jax.tree.structure(params)
  batch = {"x": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
  lowered = step.lower(params, state, batch, program="accumulate")
  counters = len(jax.tree.leaves(state)) - len(jax.tree.leaves(state.acc_grads))
  assert len(jax.tree.leaves(lowered.args_info)) == 20 + 20 + counters + 1
  rows = {"x": jax.ShapeDtypeStruct((16, 3), jnp.float32)}
  plan = optax_accum.plan_micro_batches(
    loss_fn, optax.sgd(0.1), params, rows, memory_budget=2**30, progress=False
  )
  assert plan.micro_batch >= 1

"""The packed accumulator (issue 29, item 2; issue 41): fewer buffers, the same numbers.

On one device ``opt.init(params)`` packs the sums of many small leaves in one
buffer per dtype (:mod:`optax_accum._core._layout`), and the step (streaming
or scan) passes them so. Every program's results must stay bit-identical to
the one-sum layout's, on the benchmark models, through a naive orbax restore
and into every path that does not pack.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from benchmarks import accumulation
from optax_accum._core import _backend, _layout
from optax_accum._step import _layout as _step_layout
from optax_accum._step import _packed
from optax_accum._step._programs import counters as _counters
from optax_accum._step._signature import Inputs, Split

K = 4


def _min_leaves(monkeypatch, n, **choices):
  """Packs groups of at least ``n`` small leaves on the default backend
  (with its other ``choices`` changed)."""
  platform = jax.default_backend()
  chosen = _backend.of(platform)._replace(min_leaves=n, **choices)
  monkeypatch.setitem(_backend._BACKENDS, platform, chosen)


def _bitwise_equal(a, b) -> bool:
  same = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)
  return jax.tree.structure(a) == jax.tree.structure(b) and all(jax.tree.leaves(same))


def _stream(model, calls, min_leaves, monkeypatch, two_programs=True, **step_kwargs):
  """A streaming run of ``calls`` micro-batches with groups of at least
  ``min_leaves`` leaves packed, a window ending in two programs or one:
  params, state (one sum), metrics, layout."""
  _min_leaves(monkeypatch, min_leaves, two_programs=two_programs)
  opt = optax_accum.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt, **step_kwargs)
  params = jax.tree.map(jnp.copy, model["params"])
  state, metrics = step.init(params), []
  rng = np.random.default_rng(0)
  for call in range(calls):
    rows = model["batch"](model["rows"])
    if "mask" in rows:  # Now and then a micro-batch of padding: weight 0.
      rows["mask"] = rows["mask"] * (rng.random() < 0.8)
    end_window = call == K + 1  # The second window ends early.
    params, state, out = step(params, state, rows, end_window=end_window)
    metrics.append(out)
  state = state._replace(acc_grads=_layout.one_sum(state.acc_grads))
  return params, state, metrics, step._known.layout


@pytest.mark.parametrize(
  "name", [pytest.param("leaves-400x32-b4", marks=pytest.mark.long), "lm-1x8-b2"]
)
def test_packed_programs_are_bit_identical_on_the_benchmark_models(name, monkeypatch):
  """Ten micro-steps (2.5 windows): params, optimizer state, the window's
  sums and every metric bit for bit as in the one-sum layout."""
  one_sum = _stream(accumulation.MODELS[name](), 10, 10**9, monkeypatch)
  packed = _stream(accumulation.MODELS[name](), 10, 2, monkeypatch)
  assert one_sum[3] is _step_layout.ONE_SUM
  assert isinstance(packed[3], _packed.PackedLayout)
  for what, a, b in zip(["params", "state", "metrics"], one_sum, packed, strict=False):
    assert _bitwise_equal(a, b), what


def test_a_backend_without_two_programs_ends_a_packed_window_in_one(monkeypatch):
  """Where the backend seam says one program (GPUs), a packed window's last
  call runs the merged update program, bit-identical to the one-sum layout."""
  one_sum = _stream(accumulation.MODELS["lm-1x8-b2"](), 10, 10**9, monkeypatch)
  model = accumulation.MODELS["lm-1x8-b2"]()
  packed = _stream(model, 10, 2, monkeypatch, two_programs=False)
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  batch = model["batch"](model["rows"])
  _, _, packing = step._layouts.arranged(
    model["params"], step.init(model["params"]), batch
  )
  update = step._layouts.programs(packing).update
  assert isinstance(update, _step_layout.Bound)  # Not a Split.
  for what, a, b in zip(["params", "state", "metrics"], one_sum, packed, strict=False):
    assert _bitwise_equal(a, b), what


def _scan(model, windows, min_leaves, monkeypatch, own=False):
  """A scan-mode run of ``windows`` windows of ``K`` micro-batches (``own``:
  from the inner optimizer's own state): params, inner state, metrics."""
  _min_leaves(monkeypatch, min_leaves)
  opt = optax_accum.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt, mode="scan")
  params = jax.tree.map(jnp.copy, model["params"])
  state = opt.inner_opt.init(params) if own else opt.init(params)
  metrics = []
  for _ in range(windows):
    window = optax_accum.split_micro_batches(model["batch"](K * model["rows"]), K)
    params, state, out = step(params, state, window)
    metrics.append({k: v for k, v in out.items() if k != "update_count"})
  return params, state if own else state.inner_opt_state, metrics


def test_scan_mode_packs_and_starts_empty_windows_bit_identically(monkeypatch):
  """Scan mode packs a state's sums as streaming does, and from the inner
  optimizer's own state keeps them inside the program: three windows give
  the same params, inner state and metrics bit for bit every way (on the
  LM's leaves of many shapes)."""
  model = accumulation.MODELS["lm-1x8-b2"]
  one_sum = _scan(model(), 3, 10**9, monkeypatch)
  assert _bitwise_equal(one_sum, _scan(model(), 3, 2, monkeypatch))
  assert _bitwise_equal(one_sum, _scan(model(), 3, 2, monkeypatch, own=True))


def test_scan_from_the_inner_state_passes_no_sums():
  """From ``tx.init(params)`` the scan program neither takes nor returns the
  window's sums (a buffer a leaf): the host passes params, inner state,
  counters and batch, and gets back params, inner state, counters, metrics."""
  model = accumulation.MODELS["lm-1x8-b2"]()
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt, mode="scan")
  params, inner = model["params"], opt.inner_opt.init(model["params"])
  window = optax_accum.split_micro_batches(model["batch"](K * model["rows"]), K)
  lowered = step.lower(params, inner, window)
  compiled = lowered.compile()
  counters = _counters(opt.init(params))
  expected_in = [params, inner, counters, window]
  assert len(jax.tree.leaves(lowered.args_info)) == len(jax.tree.leaves(expected_in))
  expected_out = [params, inner, counters]
  metrics = len(jax.tree.leaves(jax.eval_shape(step, params, inner, window)[2]))
  outputs = len(jax.tree.leaves(compiled.output_shardings))
  assert outputs == len(jax.tree.leaves(expected_out)) + metrics


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's two programs")
def test_a_packed_window_ends_in_two_programs_within_the_merged_ones_memory():
  """The window's last call runs the accumulate program, then ``finish``;
  ``lower`` gives the two as one program, whose peak bounds each's (the
  inner state resident while the accumulate program runs)."""
  model = accumulation.many_leaves(64, 32, 4)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  params, batch = model["params"], model["batch"](2)
  params, state, packing = step._layouts.arranged(params, step.init(params), batch)
  accumulate, update = step._layouts.programs(packing)
  assert isinstance(update, Split)
  assert update.accumulate is accumulate
  inner, acc, counters = state.inner_opt_state, state.acc_grads, _counters(state)
  inputs = Inputs(params, inner, acc, counters, batch, None, False)
  merged = _peak(update.lower(inputs))
  resident = sum(x.nbytes for x in jax.tree.leaves(inner))
  accumulating = _peak(accumulate.lower(inputs._replace(inner=None, end_window=None)))
  assert accumulating + resident <= merged
  finishing = inputs._replace(batch=None)
  assert _peak(update.ending.lower(finishing)) <= merged


def _peak(lowered) -> int:
  m = lowered.compile().memory_analysis()
  return (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
  )


def _program(model, program):
  """Buffers in and out of one of the streaming step's programs, and XLA's
  bytes accessed and scratch bytes."""
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  params = model["params"]
  lowered = step.lower(params, step.init(params), model["batch"](2), program=program)
  compiled = lowered.compile()
  buffers = len(jax.tree.leaves(lowered.args_info))
  buffers_out = len(jax.tree.leaves(compiled.output_shardings))
  bytes_ = compiled.cost_analysis()["bytes accessed"]
  return buffers, buffers_out, bytes_, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's figures")
@pytest.mark.parametrize(
  "program", ["accumulate", pytest.param("update", marks=pytest.mark.long)]
)  # The update program's figures: 28 s of CPU, in the long run.
def test_a_model_of_many_small_leaves_is_packed_by_default(program, monkeypatch):
  """400 leaves of 32x32: 50 buffers of sums in place of 400, in and out.
  The price: in the update, one more pass over the sums (cut into leaves for
  the optimizer); as scratch, a few groups' gradients (live until they are
  concatenated) and in the update the cut sums. The accumulate program,
  whose concatenation XLA fuses into the add, accesses no more bytes than
  the unpacked one."""
  model = accumulation.MODELS["leaves-400x32-b4"]()
  packed = _program(model, program)
  _min_leaves(monkeypatch, 10**9)
  one_sum = _program(model, program)
  max_group = _backend.of(jax.default_backend()).max_group_size
  fewer = 400 - -(-400 * 32 * 32 // max_group)  # 50 groups of 8 leaves.
  assert (one_sum[0] - packed[0], one_sum[1] - packed[1]) == (fewer, fewer)
  sums = 400 * 32 * 32 * 4
  passes, scratch = {"accumulate": (0, sums // 2), "update": (1, sums)}[program]
  assert packed[2] <= one_sum[2] + 2 * passes * sums
  assert one_sum[3] < packed[3] <= one_sum[3] + scratch


@pytest.mark.parametrize("committed", [False, True])
def test_step_init_packs_zeros_without_a_program(committed, monkeypatch, caplog):
  """``step.init``'s packed sums are ``pack(opt.init(params))``'s, bit for bit,
  placed alike (committed to the params' device or not: else the first call's
  program compiles twice), made without compiling a program (a first window
  on 176 leaves compiled one for 0.2 s)."""
  _min_leaves(monkeypatch, 2)
  model = accumulation.many_leaves(20, 8, 2)
  device = jax.devices()[-1] if committed else jax.devices()[0]
  params = jax.device_put(model["params"], device if committed else None)
  opt = optax_accum.MultiSteps(optax.adamw(1e-3), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  opt.init(params)  # Whatever opt.init compiles, it compiles here.
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
  want = _layout.pack(opt.init(params).acc_grads, state.acc_grads.packing)
  assert _bitwise_equal(state.acc_grads, want)
  placed = {(x.committed, *x.devices()) for x in jax.tree.leaves(state.acc_grads)}
  assert placed == {(committed, device)}
  abstract = jax.eval_shape(step.init, params).acc_grads
  assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == jax.tree.map(
    lambda x: (x.shape, x.dtype), state.acc_grads
  )
  with caplog.at_level("WARNING"), jax.log_compiles(True):
    for _ in range(2 * K):  # Two windows: each program compiles once.
      params, state, _ = step(params, state, model["batch"](model["rows"]))
  compiled = collections.Counter(
    record.getMessage().split("jit(")[1].split(")")[0]
    for record in caplog.records
    if record.getMessage().startswith("Compiling jit(")
  )
  assert compiled["accumulate"] == 1 and set(compiled.values()) == {1}, compiled


def test_plan_groups_small_leaves_by_dtype_and_size():
  acc = {
    "big": jnp.zeros((300, 300)),
    "empty": jnp.zeros((0, 4)),
    "f32": [jnp.zeros((2, 3)) for _ in range(3)],
    "f16": [jnp.zeros(5, jnp.float16) for _ in range(2)],
    "lone": jnp.zeros(7, jnp.bfloat16),
  }
  packing = _layout.plan(acc, max_leaf_size=1000, min_leaves=2)
  leaves = jax.tree.leaves(acc)
  groups = [[jnp.shape(leaves[i]) for i in group] for group in packing.groups]
  assert groups == [[(5,)] * 2, [(2, 3)] * 3]
  assert [jnp.shape(leaves[i]) for i in packing.rest] == [(300, 300), (0, 4), (7,)]
  assert _layout.plan(acc, max_leaf_size=1000, min_leaves=4) is None
  packed = _layout.pack(acc, packing)
  assert isinstance(packed, _layout.Packed) and packed.packing == packing
  assert _bitwise_equal(_layout.unpack(packed), acc)
  # Gradients of another dtype than the sums' (float16 params here) pack apart.
  params = {**acc, "f32": [jnp.zeros((2, 3), jnp.float16), *acc["f32"][1:]]}
  packing = _layout.plan(acc, params, max_leaf_size=1000, min_leaves=2)
  assert [len(group) for group in packing.groups] == [2, 2]
  # Groups of at most max_group_size elements, none of one leaf.
  acc = [jnp.zeros((2, 3)) for _ in range(5)]
  assert _layout.plan(acc, min_leaves=2, max_group_size=12).groups == ((0, 1), (2, 3))


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def _init(opt, params):
  """``step.init(params)`` of a streaming step of ``opt``."""
  return optax_accum.make_train_step(lambda p, b: (0.0, 1.0), opt).init(params)


def test_the_layout_is_the_params_rule_never_a_shape(monkeypatch):
  """``step.init`` packs by the rule of the params (one device, no loss
  terms, no ``should_skip_update_fn``) and ``opt.init`` never does; a packed
  state and a one-sum state of the same shapes are told apart by their
  structure."""
  _min_leaves(monkeypatch, 2)
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  opt = optax_accum.MultiSteps(optax.sgd(0.1), K)
  packed = _init(opt, params).acc_grads
  assert isinstance(packed, _layout.Packed) and packed.groups[0].shape == (5,)
  assert isinstance(opt.init(params).acc_grads, dict)
  terms = optax_accum.MultiSteps(optax.sgd(0.1), K, terms=("x", "y"))
  assert not isinstance(_init(terms, params).acc_grads, _layout.Packed)
  skip = optax_accum.MultiSteps(
    optax.sgd(0.1), K, should_skip_update_fn=lambda u, s, p: (False, ())
  )
  assert not isinstance(_init(skip, params).acc_grads, _layout.Packed)
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  spread = jax.device_put(params, NamedSharding(mesh, P()))
  assert not isinstance(_init(opt, spread).acc_grads, _layout.Packed)


def _checkpointed(model, split, tmp_path, monkeypatch):
  """Streams ``split`` micro-batches with packing, saves with orbax, and
  restores against ``step.init(params)``: the batches that remain."""
  _min_leaves(monkeypatch, 2)
  # Momentum, not Adam: Adam turns the rounding of the key bias's gradient
  # (0 but for rounding) into steps of its learning rate, path by path.
  opt = optax_accum.MultiSteps(optax.sgd(0.1, momentum=0.9), K)
  step = optax_accum.make_train_step(model["loss_fn"], opt)
  batches = [model["batch"](model["rows"]) for _ in range(3 * K)]
  params = jax.tree.map(jnp.copy, model["params"])
  state = step.init(params)
  for batch in batches[:split]:
    params, state, _ = step(params, state, batch)
  assert isinstance(step._known.layout, _packed.PackedLayout)
  saver = ocp.StandardCheckpointer()
  saver.save(tmp_path / "ckpt", {"params": params, "opt_state": state, "position": 0})
  saver.wait_until_finished()
  fresh = jax.tree.map(jnp.zeros_like, model["params"])
  target = {"params": fresh, "opt_state": step.init(fresh), "position": 0}
  restored = saver.restore(tmp_path / "ckpt", target)
  return opt, restored["params"], restored["opt_state"], batches


def _finish(step, params, state, batches):
  """``step`` over ``batches`` from copies of ``params`` and ``state``."""
  params, state = jax.tree.map(jnp.copy, (params, state))
  for batch in batches:
    params, state, _ = step(params, state, batch)
  return params, state


def _paths(model, opt):
  """``(step, place params, place batch)`` of paths that never pack: the
  step inside the user's ``jit``, and under plain ``jit`` on a mesh of 2
  devices (Auto axes: the model's embedding lookup has no rule for
  Explicit ones)."""
  in_jit = jax.jit(optax_accum.make_train_step(model["loss_fn"], opt, donate=False))
  auto = (jax.sharding.AxisType.Auto,)
  mesh = jax.make_mesh((2,), ("data",), axis_types=auto, devices=jax.devices()[:2])
  on_mesh = optax_accum.make_train_step(model["loss_fn"], opt)
  same = lambda tree: tree  # noqa: E731
  return [
    (in_jit, same, same),
    (
      on_mesh,
      lambda t: jax.device_put(t, NamedSharding(mesh, P())),
      lambda t: jax.device_put(t, NamedSharding(mesh, P("data"))),
    ),
  ]


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
@pytest.mark.long  # 12-20 s of CPU each; in CI test_checkpoint_layouts.py resumes
# a packed state's naive restore mid-window on every path.
@pytest.mark.parametrize("split", [2, K + 3], ids=["first-window", "second-window"])
def test_a_packed_checkpoint_resumes_on_every_path(split, tmp_path, monkeypatch):
  """Restored against ``step.init(params)``: a fresh streaming step resumes
  bit-identical. Paths that never pack unpack it and end within 1e-6 of
  their own uninterrupted run."""
  model = accumulation.MODELS["lm-1x8-b2"]()
  opt, params, state, batches = _checkpointed(model, split, tmp_path, monkeypatch)
  fresh = optax_accum.make_train_step(model["loss_fn"], opt)
  uninterrupted = _finish(fresh, model["params"], opt.init(model["params"]), batches)
  resumed = _finish(
    optax_accum.make_train_step(model["loss_fn"], opt), params, state, batches[split:]
  )
  assert _bitwise_equal(uninterrupted[0], resumed[0])
  for step, place_params, place_batch in _paths(model, opt):
    batches_ = [place_batch(b) for b in batches]
    params0 = place_params(model["params"])
    want, _ = _finish(step, params0, opt.init(params0), batches_)
    got, _ = _finish(step, place_params(params), state, batches_[split:])
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      jax.device_get(want),
      jax.device_get(got),
    )


def test_a_packed_state_joins_a_scan_window(monkeypatch):
  """A window streamed halfway (packed) and finished by a scan-mode step:
  the same params as the whole window streamed."""
  model = accumulation.MODELS["lm-1x8-b2"]()
  _min_leaves(monkeypatch, 2)
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), K)
  stream = optax_accum.make_train_step(model["loss_fn"], opt, donate=False)
  scan = optax_accum.make_train_step(model["loss_fn"], opt, mode="scan", donate=False)
  batches = [model["batch"](model["rows"]) for _ in range(K)]
  params, state = model["params"], stream.init(model["params"])
  for batch in batches[:2]:
    params, state, _ = stream(params, state, batch)
  assert isinstance(stream._known.layout, _packed.PackedLayout)
  rest = jax.tree.map(lambda *rows: np.stack(rows), *batches[2:])
  got, state, _ = scan(params, state, rest)
  want, _ = _finish(stream, model["params"], opt.init(model["params"]), batches)
  assert int(state.gradient_step) == 1
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), want, got)


def test_multi_steps_update_takes_a_packed_state_and_keeps_it_packed(monkeypatch):
  """``opt.update`` by hand on the step's packed state: unpacked inside,
  packed again, bit for bit the one-sum arithmetic; params that gained a
  leaf are named at once, by the step and by ``opt.update``."""
  _min_leaves(monkeypatch, 2)
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  opt = optax_accum.MultiSteps(optax.sgd(0.1), K)

  def loss_fn(params, batch):
    return sum(v.sum() for v in params.values()) * batch, 1.0

  step = optax_accum.make_train_step(loss_fn, opt, donate=False)
  _, state, _ = step(params, step.init(params), jnp.float32(1))
  assert isinstance(state.acc_grads, _layout.Packed)
  grads = jax.tree.map(jnp.ones_like, params)
  _, got = jax.jit(opt.update)(grads, state, params)
  assert isinstance(got.acc_grads, _layout.Packed)
  plain = state._replace(acc_grads=_layout.unpack(state.acc_grads))
  _, want = opt.update(grads, plain, params)
  assert _bitwise_equal(_layout.unpack(got.acc_grads), want.acc_grads)
  grown = {**params, "c": jnp.ones(4)}
  with pytest.raises(ValueError, match=r"leaf \['c'\]"):
    opt.update(jax.tree.map(jnp.ones_like, grown), state, grown)
  with pytest.raises(ValueError, match=r"leaf \['c'\]"):
    step(grown, state, jnp.float32(1))

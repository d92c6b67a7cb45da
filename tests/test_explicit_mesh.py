"""JAX's default mesh: ``jax.make_mesh`` gives ``Explicit`` axes (jax >= 0.7).

On an ``Explicit`` mesh shardings are part of JAX's types, and an op whose
output sharding is ambiguous is an error instead of the compiler's choice.
Issue 25, item 2: the ``axis_name`` step built its per-replica accumulator
with ``.at[0].set`` of a sum split over ``model``, a sharding type error.
Here a 1-D ``data`` mesh and a 2-D ``data`` x ``model`` mesh (params split
over ``model``, Megatron style), with and without ``axis_name``, streaming
and scan mode, all end where one device does on the whole batch.
"""

import collections
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from benchmarks.hlo import collectives

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, WINDOWS, ROWS, LENGTH = 2, 2, 16, 5
#: Collectives of at most this many bytes carry counters and window totals.
SCALARS = 64
#: Where each param is split on the 2-D mesh: column- then row-parallel.
MODEL_SPECS = {"hidden": P(None, "model"), "out": P("model", None)}


def _mlp_loss(params, batch):
  """Token-mean cross-entropy of a 2-layer MLP and the valid tokens.

  The second matmul contracts a dimension that may be split over `model`;
  an Explicit mesh asks where its result goes: where the rows are.
  """
  hidden = jnp.tanh(batch["x"] @ params["hidden"])
  rows = tuple(jax.typeof(hidden).sharding.spec)[:-1]
  logits = jnp.einsum("btf,fo->bto", hidden, params["out"], out_sharding=P(*rows, None))
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return (nll * batch["mask"]).sum() / batch["mask"].sum(), batch["mask"].sum()


def _params(width=8):
  rng = np.random.default_rng(0)
  return {
    "hidden": rng.normal(size=(3, width)).astype(np.float32),
    "out": (rng.normal(size=(width, 4)) / width**0.5).astype(np.float32),
  }


def _batches():
  """One batch per window, longest sequences first: the last replicas hold
  almost nothing but padding."""
  rng = np.random.default_rng(1)
  out = []
  for _ in range(WINDOWS):
    rows = K * ROWS
    lengths = np.sort(rng.integers(1, LENGTH + 1, rows))[::-1]
    lengths[-rows // 4 :] = 1
    out.append(
      {
        "x": rng.normal(size=(rows, LENGTH, 3)).astype(np.float32),
        "y": rng.integers(0, 4, (rows, LENGTH)),
        "mask": (np.arange(LENGTH) < lengths[:, None]).astype(np.float32),
      }
    )
  return out


def _adamw():
  return optax.adamw(3e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def whole():
  """The oracle: AdamW on the whole batch, one device (a 1 x 1 mesh, so the
  loss's `out_sharding` has a mesh to name)."""
  one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
  with jax.set_mesh(one):
    params, _, _ = toy_lm.whole_batch_run(_params(), _batches(), _adamw(), _mlp_loss)
  return jax.device_get(params)


def _mesh(name):
  if name == "1d":
    return jax.make_mesh((8,), ("data",))
  return jax.make_mesh((4, 2), ("data", "model"))


def _param_specs(mesh_name):
  if mesh_name == "2d":
    return MODEL_SPECS
  return {"hidden": P(None, None), "out": P(None, None)}


def _window_input(batch, mode, mesh):
  """One window as the step takes it: k stacked micro-batches in scan mode,
  the list of k micro-batches to stream; rows split over `data`."""
  if mode == "scan":
    stacked = optax_accum.split_micro_batches(batch, K)
    return [jax.device_put(stacked, NamedSharding(mesh, P(None, "data")))]
  rows = NamedSharding(mesh, P("data"))
  return [jax.device_put(mb, rows) for mb in toy_lm.split(batch, K)]


Run = collections.namedtuple("Run", "mesh_name axis_name mode mesh step params state")


def _start(mesh_name, step):
  """Params and the optimizer state placed as the step returns them (P(None,
  None), not P(): the same sharding, spelled so jit's cache sees it), so the
  programs compile once; the state from ``step.init``, which keeps partial
  sums on these meshes (``opt.init``'s one sum stays one sum)."""
  mesh = _mesh(mesh_name)
  specs = _param_specs(mesh_name)
  params = {
    name: jax.device_put(value, NamedSharding(mesh, specs[name]))
    for name, value in _params().items()
  }
  with jax.set_mesh(mesh):
    return mesh, params, step.init(params)


@functools.cache
def _trained(mesh_name, axis_name, mode):
  """A trained run, shared by the tests. Without `axis_name` the loss sees
  the global batch and its `out_sharding` names `data`, so JAX needs the mesh
  set. With it the loss runs in the step's `shard_map`, which sets the mesh:
  issue 25 saw the step fail both ways, so the 2-D scan run sets it and the
  others do not."""
  set_mesh = axis_name is None or (mesh_name, mode) == ("2d", "scan")
  opt = optax_accum.MultiSteps(_adamw(), K)
  step = optax_accum.make_train_step(_mlp_loss, opt, mode=mode, axis_name=axis_name)
  mesh, params, state = _start(mesh_name, step)
  with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
    for batch in _batches():
      for call in _window_input(batch, mode, mesh):
        params, state, metrics = step(params, state, call)
  assert int(metrics["update_count"]) == WINDOWS
  return Run(mesh_name, axis_name, mode, mesh, step, params, state)


@pytest.fixture(
  scope="module",
  params=[
    (mesh, axis_name, mode)
    for mesh in ("1d", "2d")
    for axis_name in ("data", None)
    for mode in ("stream", "scan")
  ],
  ids=lambda p: f"{p[0]}-{p[1] or 'jit'}-{p[2]}",
)
def run(request):
  return _trained(*request.param)


def test_explicit_mesh_matches_the_whole_batch(run, whole):
  assert jax.typeof(run.params["hidden"]).sharding.mesh.axis_types[0] == (
    jax.sharding.AxisType.Explicit
  )
  assert toy_lm.max_rel_diff(jax.device_get(run.params), whole) <= 1e-5


def test_accumulator_and_params_keep_the_model_split(run):
  """Params and AdamW's moments stay split like the params; the accumulator
  too, after a leading replica axis split over `data`: each device's partial
  sum, with `axis_name` and without (issue 25, item 1)."""
  specs = _param_specs(run.mesh_name)
  adam = run.state.inner_opt_state[0]
  for name, spec in specs.items():
    for tree in (run.params, adam.mu, adam.nu):
      assert tree[name].sharding.spec == spec, name
    acc = run.state.acc_grads.sums[name]
    want = NamedSharding(run.mesh, P("data", *spec))
    assert acc.sharding.is_equivalent_to(want, acc.ndim), (name, acc.sharding)


@pytest.mark.parametrize(
  ("mesh_name", "axis_name", "mode"),
  [
    (m, a, mode)
    for m, a in [("1d", "data"), ("1d", None), ("2d", None)]
    for mode in ("stream", "scan")
  ],
)
def test_an_explicit_mesh_reduces_gradients_once_per_window(mesh_name, axis_name, mode):
  """Read from the compiled programs: while accumulating no collective over
  `data` the size of a gradient, and one all-reduce of the params' (or each
  model shard's) bytes when the window ends, after the scan's loop. Without
  `axis_name` too (issue 25, item 1): the loss sees the global batch and its
  gradient stays each device's partial sum until then. On the 2-D mesh the
  row-parallel matmul sums its activations over `model`, in the loop too:
  the model's own collective, which the test tells apart by its size."""
  run = _trained(mesh_name, axis_name, mode)
  call = _window_input(_batches()[0], mode, run.mesh)[0]
  params = sum(x.nbytes for x in jax.tree.leaves(_params()))
  shard = params // (2 if mesh_name == "2d" else 1)
  activations = ROWS // 4 * LENGTH * 4 * 4  # Per device: rows, length, 4 logits.

  def gradient_sized(program):
    with jax.set_mesh(run.mesh):
      lowered = run.step.lower(run.params, run.state, call, program=program)
    found = collectives(lowered.compile().as_text())
    return [c for c in found if c.bytes > SCALARS and c.bytes != activations]

  update = gradient_sized("update")
  assert [(c.kind, c.in_loop) for c in update] == [("all-reduce", False)], update
  assert 0 <= update[0].bytes - shard <= SCALARS, (update, shard)
  if mode == "stream":
    assert gradient_sized("accumulate") == []


def _plain_mlp_loss(params, batch):
  """`_mlp_loss` without `out_sharding`: for a mesh whose `model` axis is Auto."""
  logits = jnp.tanh(batch["x"] @ params["hidden"]) @ params["out"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return (nll * batch["mask"]).sum() / batch["mask"].sum(), batch["mask"].sum()


def test_dp_x_tp_with_an_auto_model_axis_reduces_once_per_window():
  """What docs/distributed.md recommends for `axis_name` with a `model` axis:
  `axis_types=(Explicit, Auto)`. jax 0.10's `shard_map` over `data` alone
  replicates Explicit `model` axes where values enter it (the step then
  gathers params and accumulator each micro-step); an Auto one it leaves
  split: no collective the size of a gradient while accumulating, one
  all-reduce of each device's half of the params when the window ends. The
  hidden layer is wide enough for its gradient to outweigh the activations
  the row-parallel matmul sums over `model`."""
  explicit, auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit, auto))
  wide = _params(width=256)
  params = {
    name: jax.device_put(value, NamedSharding(mesh, MODEL_SPECS[name]))
    for name, value in wide.items()
  }
  opt = optax_accum.MultiSteps(_adamw(), K)
  step = optax_accum.make_train_step(_plain_mlp_loss, opt, axis_name="data")
  with jax.set_mesh(mesh):  # Sums and moments split over `model` as the params.
    state = step.init(params)
  half = sum(x.nbytes for x in jax.tree.leaves(wide)) // 2
  call = _window_input(_batches()[0], "stream", mesh)[0]

  def gradient_sized(program):
    text = step.lower(params, state, call, program=program).compile().as_text()
    return [c for c in collectives(text) if c.bytes > half // 2]

  assert gradient_sized("accumulate") == []
  update = gradient_sized("update")
  assert [c.kind for c in update] == ["all-reduce"], update
  assert 0 <= update[0].bytes - half <= SCALARS, update  # With the window's totals.


def _weighted_loss(weight):
  """`_mlp_loss` with its weight as users write it: the valid tokens, a
  Python constant, or a constant array."""

  def loss_fn(params, batch):
    loss, tokens = _mlp_loss(params, batch)
    return loss, {"tokens": tokens, "python": 1.0, "array": jnp.ones(())}[weight]

  return loss_fn


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize("weight", ["tokens", "python", "array"])
def test_every_kind_of_weight_matches_one_device(weight, mode):
  """Without `axis_name` the loss sees the global batch, so whatever its
  weight, the 8 devices end where one device does with the same step (a
  constant weight under `shard_map` once scaled updates by the replica
  count). Each of the 8 devices keeps its own partial sum; a mesh of one
  device has nothing to reduce and keeps one sum."""
  loss_fn = _weighted_loss(weight)
  ends = []
  for mesh in (jax.make_mesh((8,), ("data",)), _one_device_mesh()):
    opt = optax_accum.MultiSteps(_adamw(), K)
    step = optax_accum.make_train_step(loss_fn, opt, mode=mode)
    params = jax.device_put(_params(), NamedSharding(mesh, P(None, None)))
    with jax.set_mesh(mesh):
      state = step.init(params)  # Partial sums (opt.init's one sum stays one).
      for batch in _batches():
        for call in _window_input(batch, mode, mesh):
          params, state, _ = step(params, state, call)
    replicas = mesh.shape["data"]
    acc = getattr(state.acc_grads, "sums", state.acc_grads)
    assert acc["out"].shape == ((replicas,) if replicas > 1 else ()) + (
      8,
      4,
    )
    ends.append(jax.device_get(params))
  assert toy_lm.max_rel_diff(*ends) <= 1e-5


def _one_device_mesh():
  return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])


def test_params_jax_cannot_type_reduced_keep_a_reduction_per_micro_batch():
  """A bias and a learned position table meet activations split over `data`
  in an add, which jax 0.10 refuses for a `reduced` operand: the first call's
  tracing finds them (the table among the 2-D params it tries) and leaves
  them to XLA's reduction per micro-batch; the two matmuls' gradients still
  wait for the window's end, and the numbers are one device's."""
  rng = np.random.default_rng(2)
  params = {
    "position": rng.normal(size=(LENGTH, 3)).astype(np.float32) / 4,
    "hidden": rng.normal(size=(3, 8)).astype(np.float32),
    "bias": np.zeros(8, np.float32),
    "out": (rng.normal(size=(8, 4)) / 8**0.5).astype(np.float32),
  }

  def loss_fn(params, batch):
    hidden = jnp.tanh((batch["x"] + params["position"][None]) @ params["hidden"])
    logits = (hidden + params["bias"][None, None]) @ params["out"]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return (nll * batch["mask"]).sum() / batch["mask"].sum(), batch["mask"].sum()

  ends, micro_step = [], {}
  for mesh in (jax.make_mesh((8,), ("data",)), _one_device_mesh()):
    opt = optax_accum.MultiSteps(_adamw(), K)
    step = optax_accum.make_train_step(loss_fn, opt)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
      state = step.init(placed)
      for batch in _batches():
        for call in _window_input(batch, "stream", mesh):
          placed, state, _ = step(placed, state, call)
      if mesh.size == 8:
        text = step.lower(placed, state, call, program="accumulate").compile()
        micro_step = collections.Counter(c.bytes for c in collectives(text.as_text()))
    ends.append(jax.device_get(placed))
  assert toy_lm.max_rel_diff(*ends) <= 1e-5
  # Every micro-step: the position table and the bias, and a few scalars
  # (XLA may combine them into one all-reduce); never a matmul weight.
  sizes = {name: value.nbytes for name, value in params.items()}
  summed = sum(size for size in micro_step.elements() if size > SCALARS)
  extra = summed - sizes["position"] - sizes["bias"]
  assert 0 <= extra < min(sizes["hidden"], sizes["out"]), (micro_step, sizes)


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize(
  ("axis_type", "axis_name"),
  [("explicit", None), ("explicit", "data"), ("auto", None), ("auto", "data")],
)
def test_each_program_compiles_once_on_a_mesh(axis_type, axis_name, mode, caplog):
  """Params placed with `P()` came back from the first update as `P(None,
  None)` (the same sharding, another key to jit's cache) and the counters
  from `opt.init` on no mesh came back on it: every program compiled twice.
  The step now places a state it did not return as its programs return it.
  Fresh loss function and optimizer: no program of another test is reused."""
  types = (jax.sharding.AxisType.Auto,) if axis_type == "auto" else None
  mesh = jax.make_mesh((8,), ("data",), axis_types=types)

  def loss_fn(params, batch):
    return _mlp_loss(params, batch)

  opt = optax_accum.MultiSteps(optax.adamw(1e-2), K)
  step = optax_accum.make_train_step(loss_fn, opt, mode=mode, axis_name=axis_name)
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = opt.init(params)
  caplog.clear()
  with jax.set_mesh(mesh), caplog.at_level("WARNING"), jax.log_compiles(True):
    for batch in _batches():
      for call in _window_input(batch, mode, mesh):
        params, state, _ = step(params, state, call)
  compiled = collections.Counter(
    message.split("jit(")[1].split(")")[0]
    for message in (record.getMessage() for record in caplog.records)
    if message.startswith("Compiling jit(")
  )
  step_programs = ("accumulate", "update", "scan")
  programs = {n: c for n, c in compiled.items() if n.startswith(step_programs)}
  assert programs and set(programs.values()) == {1}, compiled


def _term_loss(params, batch):
  """Three terms with their own counts: tokens, sequences, 1 per call. The
  lookup's rows stay where the token ids are (an Explicit mesh asks)."""
  losses, mask = toy_lm.token_losses(params, batch, rows=P("data", None, None))
  tokens, per_sequence = mask.sum(), losses.sum(axis=1)
  sequences = (mask.sum(axis=1) > 0).astype(jnp.float32)
  aux = 0.1 * jnp.sum(params["head"]["w"] ** 2)
  return {
    "ce": (losses.sum() / jnp.maximum(tokens, 1), tokens),
    "seq": (per_sequence.sum() / jnp.maximum(sequences.sum(), 1), sequences.sum()),
    "aux": (aux, jnp.float32(1)),
  }


# CI time: scan mode's one reduction a window is also
# test_an_explicit_mesh_reduces_gradients_once_per_window's.
@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_loss_terms_reduce_once_per_window_too(mode):
  """Each term's accumulator keeps each device's partial sum, and 8 devices
  end where one does (issue 28's terms on issue 25's default path)."""
  ends = []
  for mesh in (jax.make_mesh((8,), ("data",)), _one_device_mesh()):
    opt = optax_accum.MultiSteps(_adamw(), K, terms=("ce", "seq", "aux"))
    step = optax_accum.make_train_step(_term_loss, opt, mode=mode)
    params = jax.device_put(toy_lm.init_params(seed=0), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
      state = step.init(params)
      for seed in range(WINDOWS):
        batch = toy_lm.make_batch(seed=seed, batch=K * ROWS)
        for call in _window_input(batch, mode, mesh):
          params, state, metrics = step(params, state, call)
    assert int(metrics["update_count"]) == WINDOWS
    leading = {a.shape[0] for a in jax.tree.leaves(state.acc_grads)}
    assert leading == ({8} if mesh.size == 8 else {toy_lm.VOCAB, toy_lm.WIDTH})
    ends.append(jax.device_get(params))
  assert toy_lm.max_rel_diff(*ends) <= 1e-5


def test_params_on_no_mesh_are_placed_before_the_layout_is_chosen():
  """Scan mode from the inner optimizer's own state, params on one device (not
  committed) and the window's rows split over an Explicit mesh: the step
  places the params on the batch's mesh before choosing the layout, so the
  gradient still stays each device's partial sum and is reduced once, after
  the loop."""
  mesh = _mesh("1d")
  step = optax_accum.make_train_step(_mlp_loss, _adamw(), mode="scan")
  params = jax.tree.map(jnp.asarray, _params())  # The default device's.
  window = _window_input(_batches()[0], "scan", mesh)[0]
  with jax.set_mesh(mesh):
    compiled = step.lower(params, _adamw().init(params), window).compile()
  found = [c for c in collectives(compiled.as_text()) if c.bytes > SCALARS]
  assert found and not any(c.in_loop for c in found), found
